"""The C++ decode step of kernels/delta_rule.cpp (layers/delta_kernel.py) against the torch steps it replaces:
Gated DeltaNet (a decay per head), Kimi Delta Attention (a decay per key channel) and lightning attention, on
random inputs and on sums worked out by hand."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from native_kernels import built  # noqa: E402

from kvwall.engine.layers.delta_kernel import delta_rule, delta_step_, linear_step_  # noqa: E402
from kvwall.engine.layers.gated_deltanet import gated_delta_decode_, gated_delta_step, gated_delta_step_, l2norm  # noqa: E402
from kvwall.engine.layers.lightning import lightning_decode_, lightning_step  # noqa: E402

# (B, H, dk, dv): Qwen3-Next's head (128 x 128); dk != dv with dv a whole SIMD vector plus a part (80, 136) and
# below one vector (12); batch 1 and 3
SHAPES = [(1, 2, 128, 128), (3, 4, 8, 12), (2, 3, 64, 80), (3, 2, 16, 136)]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    return built(delta_rule, "delta_rule")


def inputs(B, H, dk, dv, per_channel: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(B, H, dk, generator=g)) for _ in range(2))  # (B, H, dk): as the layers feed them
    v = torch.randn(B, H, dv, generator=g)  # (B, H, dv)
    decay = -2 * torch.rand(B, H, *([dk] if per_channel else []), generator=g)  # (B, H) or (B, H, dk): log decay
    beta = torch.rand(B, H, generator=g)  # (B, H)
    return q, k, v, decay, beta, torch.randn(B, H, dk, dv, generator=g)


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the larger magnitude (fp32 summed in another order)."""
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_delta_step_equals_the_torch_step(shape, per_channel):
    """Output and state after three steps on the same state, against the torch reference step (new tensors) and
    the torch in-place step (the fallback)."""
    q, k, v, g, beta, S = inputs(*shape, per_channel)
    S_kernel, S_torch, S_ref = S.clone(), S.clone(), S.clone()
    for step in range(3):
        o_ref, S_ref = gated_delta_step(q, k, v * (step + 1), g, beta, S_ref)
        o_torch = gated_delta_step_(q, k, v * (step + 1), g, beta, S_torch)
        o = delta_step_(q, k, v * (step + 1), g, beta, S_kernel)
        assert o is not None and o.shape == o_ref.shape == shape[:2] + (shape[3],)
        assert gap(o, o_ref) < 2e-6 and gap(S_kernel, S_ref) < 2e-6
        assert gap(o_torch, o_ref) < 2e-6 and gap(S_torch, S_ref) < 2e-6


@pytest.mark.parametrize(
    "shape", [(1, 2, 128, 128), (3, 4, 12, 12), (2, 3, 80, 80)], ids=lambda s: "x".join(map(str, s))
)
def test_linear_step_equals_lightning_step(shape):
    q, k, v, g, _, S = inputs(*shape, per_channel=False)
    v = torch.randn(shape[0], shape[1], shape[2], generator=torch.Generator().manual_seed(1))  # (B, H, d)
    o_ref, S_ref = lightning_step(q, k, v, g, S)
    o = linear_step_(q, k, v, g, S)  # S updated in place
    assert o is not None and gap(o, o_ref) < 2e-6 and gap(S, S_ref) < 2e-6


def test_a_state_with_strided_rows_and_heads():
    """S a slice of a larger tensor (heads 1..3 of 4, rows 64 apart): the kernel writes only that slice."""
    q, k, v, g, beta, _ = inputs(2, 3, 16, 32, per_channel=True)
    big = torch.randn(2, 4, 16, 64, generator=torch.Generator().manual_seed(2))
    S = big[:, 1:, :, :32]  # (2, 3, 16, 32), not contiguous
    before = big.clone()
    o_ref, S_ref = gated_delta_step(q, k, v, g, beta, S.clone())
    o = delta_step_(q, k, v, g, beta, S)
    assert gap(o, o_ref) < 2e-6 and gap(big[:, 1:, :, :32], S_ref) < 2e-6
    assert torch.equal(big[:, :1], before[:, :1]) and torch.equal(big[..., 32:], before[..., 32:])


def test_delta_rule_by_hand():
    """dk = dv = 20 (a whole AVX-512 vector and a part), one head: write v1 under key e0 (beta 1), then v2 under e0
    with beta 0.5 and the state halved (g = -ln 2): the read of e0 is 0.5 v1, the write 0.5 (v2 - 0.5 v1), so
    q = e0 reads 0.5 v1 + 0.5 (v2 - 0.5 v1) = 0.25 v1 + 0.5 v2. A key channel whose gate is -50 (KDA) forgets its
    row."""
    d = 20
    e0 = torch.zeros(1, 1, d)
    e0[..., 0] = 1.0
    v1, v2 = torch.arange(d, dtype=torch.float32)[None, None], torch.full((1, 1, d), 3.0)
    S = torch.zeros(1, 1, d, d)
    delta_step_(e0, e0, v1, torch.zeros(1, 1), torch.ones(1, 1), S)
    assert torch.equal(S[0, 0, 0], v1[0, 0]) and S[0, 0, 1:].abs().max().item() == 0
    o = delta_step_(e0, e0, v2, torch.full((1, 1), -math.log(2)), torch.full((1, 1), 0.5), S)
    assert torch.allclose(o, 0.25 * v1 + 0.5 * v2, atol=1e-5)
    e1 = torch.zeros(1, 1, d)
    e1[..., 1] = 1.0
    delta_step_(e1, e1, v2, torch.zeros(1, 1), torch.ones(1, 1), S)  # row 1 holds v2 now
    wipe0 = torch.zeros(1, 1, d)
    wipe0[..., 0] = -50.0  # KDA: forget key channel 0 only
    read0 = delta_step_(e0, e0, v1, wipe0, torch.zeros(1, 1), S)  # beta 0: write nothing
    read1 = delta_step_(e1, e1, v1, torch.zeros(1, 1, d), torch.zeros(1, 1), S)
    assert read0.abs().max().item() < 1e-20 and torch.allclose(read1, v2)


def test_lightning_geometric_sum_by_hand():
    """d = 17, q = k = e0, v = 1 from a zero state, decay s = 0.5: o_t = Σ_{j<=t} exp(-s (t - j)) = (1 - r^(t+1)) /
    (1 - r), r = exp(-s), in every one of the 17 value channels."""
    d, s = 17, 0.5
    e0 = torch.zeros(1, 1, d)
    e0[..., 0] = 1.0
    S, r = torch.zeros(1, 1, d, d), math.exp(-s)
    for t in range(5):
        o = linear_step_(e0, e0, torch.ones(1, 1, d), torch.full((1, 1), -s), S)
        assert o.flatten().tolist() == pytest.approx([(1 - r ** (t + 1)) / (1 - r)] * d, rel=1e-6)


def test_float64_states_take_the_torch_path():
    """The kernel is fp32: a float64 state (the engine's float64 checks) gets None from it, and the layers' decode
    functions fall back to the torch in-place steps, bit for bit."""
    q, k, v, g, beta, S = (t.double() for t in inputs(2, 3, 8, 12, per_channel=False))
    assert delta_step_(q, k, v, g, beta, S.clone()) is None and linear_step_(q, k, v[..., :8], g, S.clone()) is None
    S1, S2 = S.clone(), S.clone()
    assert torch.equal(gated_delta_decode_(q, k, v, g, beta, S1), gated_delta_step_(q, k, v, g, beta, S2))
    assert torch.equal(S1, S2)
    T1, T2 = S[..., :8].clone(), S[..., :8].clone()
    from kvwall.engine.layers.lightning import lightning_step_

    assert torch.equal(lightning_decode_(q, k, v[..., :8], g, T1), lightning_step_(q, k, v[..., :8], g, T2))
