"""Mamba-2's SSD: the chunked prefill and the recurrent decode step against the plain loop
(the model against transformers is in test_mamba.py)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kvwall.engine.layers.mamba2 import GatedRMSNorm, ssd_chunked, ssd_reference, ssd_step  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402


def ssd_inputs(B=2, T=45, H=4, P=8, N=6, big_dt=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=g)
    dt = torch.rand(B, T, H, generator=g) * (30.0 if big_dt else 0.3)
    dt[1, 30:] = 0.0  # a right-padded row: Δ = 0 keeps its state
    A = -torch.rand(H, generator=g) * 3 - 0.1
    Bm, Cm = torch.randn(B, T, H, N, generator=g), torch.randn(B, T, H, N, generator=g)
    return x, dt, A, Bm, Cm, torch.randn(B, H, P, N, generator=g)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
@pytest.mark.parametrize("big_dt", [False, True])
def test_chunked_ssd_equals_reference(chunk, big_dt):
    x, dt, A, Bm, Cm, h0 = ssd_inputs(big_dt=big_dt)
    y_ref, h_ref = ssd_reference(x, dt, A, Bm, Cm, h0)
    y, h = ssd_chunked(x, dt, A, Bm, Cm, h0, chunk=chunk)
    assert y.shape == y_ref.shape and torch.isfinite(y).all()
    scale = y_ref.abs().max().item()  # large Δ makes large outputs: compare relative to them
    assert (y - y_ref).abs().max().item() < 1e-5 * scale and (h - h_ref).abs().max().item() < 1e-5 * scale


def test_padding_leaves_the_state_as_after_the_last_real_token():
    x, dt, A, Bm, Cm, h0 = ssd_inputs()
    _, h_full = ssd_chunked(x, dt, A, Bm, Cm, h0, chunk=16)
    _, h_30 = ssd_reference(x[:, :30], dt[:, :30], A, Bm[:, :30], Cm[:, :30], h0)
    assert (h_full[1] - h_30[1]).abs().max().item() < 1e-5


def test_decode_step_equals_reference():
    x, dt, A, Bm, Cm, h = ssd_inputs(T=6)
    y_ref, h_ref = ssd_reference(x, dt, A, Bm, Cm, h)
    ys = []
    for t in range(6):
        y, h = ssd_step(x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], h)
        ys.append(y)
    assert (torch.stack(ys, 1) - y_ref).abs().max().item() < 1e-5 and (h - h_ref).abs().max().item() < 1e-5


def test_gated_norm_normalises_each_group_separately():
    norm = GatedRMSNorm(8, 4, eps=0.0)
    y = torch.cat([torch.full((1, 1, 4), 3.0), torch.full((1, 1, 4), -0.5)], -1)
    z = torch.full((1, 1, 8), 50.0)  # silu(50) = 50: the gate scales both groups alike
    assert torch.allclose(norm(y, z), torch.tensor([[[1.0] * 4 + [-1.0] * 4]]), atol=1e-5)


def test_time_step_limit_parses_transformers_infinity():
    config = {"model_type": "mamba2", "hidden_size": 64, "num_heads": 8, "head_dim": 16, "state_size": 16,
              "n_groups": 2, "conv_kernel": 4, "num_hidden_layers": 1, "vocab_size": 10,
              "time_step_limit": [0.0, {"__float__": "Infinity"}]}
    assert spec_from_config(config).layers[0].mixer.dt_limit == (0.0, math.inf)
