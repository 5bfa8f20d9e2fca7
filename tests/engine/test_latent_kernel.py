"""MLA's absorbed decode through the C++ kernel equals the torch absorbed path over the same cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_kernels import built  # noqa: E402

from kvwall.engine.layers.attention import visible  # noqa: E402
from kvwall.engine.layers.latent import LatentAttention  # noqa: E402
from kvwall.engine.layers.latent_kernel import mla_decode  # noqa: E402
from kvwall.spec.model import LatentAttention as LatentSpec  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    return built(mla_decode, "mla_decode")


@pytest.mark.parametrize("heads,rank,rope_dim", [(12, 256, 32), (6, 40, 8), (3, 16, 4)])
@pytest.mark.parametrize("slots", [1, 300, 700])
def test_kernel_equals_the_torch_absorbed_path(kernel, heads, rank, rope_dim, slots):
    """Rows at different positions (one shorter than the slots, one padding query), head counts that are
    not multiples of 4, widths that are not whole SIMD vectors, several chunks of 256 tokens."""
    g = torch.Generator().manual_seed(slots + heads)
    m = LatentAttention(LatentSpec(heads, rank, None, 16, rope_dim, 16), hidden=32, index=0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    B = 3
    q_nope, q_pe = torch.randn(B, 1, heads, 16, generator=g), torch.randn(B, 1, heads, rope_dim, generator=g)
    c, pe = torch.randn(B, 1, slots, rank, generator=g), torch.randn(B, 1, slots, rope_dim, generator=g)
    k_pos = torch.arange(slots)[None]  # (1, S): the contiguous cache's slots
    pos = torch.tensor([[slots - 1], [slots // 2], [-1]])  # full, half, padding
    with torch.no_grad():
        expected = m.absorbed(q_nope, q_pe, c, pe, visible(pos, k_pos, None))
        got = m.absorbed_decode(q_nope, q_pe, c, pe, k_pos, pos, kernel)
    assert got.shape == expected.shape == (B, heads, 1, 16)
    assert (got - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())


def test_slots_in_any_order_and_empty_ones(kernel):
    """A paged cache hands slots in block order with -1 for the empty ones: the kernel masks by position."""
    g = torch.Generator().manual_seed(5)
    m = LatentAttention(LatentSpec(4, 32, None, 8, 8, 8), hidden=16, index=0)
    B, S = 2, 520
    q_nope, q_pe = torch.randn(B, 1, 4, 8, generator=g), torch.randn(B, 1, 4, 8, generator=g)
    c, pe = torch.randn(B, 1, S, 32, generator=g), torch.randn(B, 1, S, 8, generator=g)
    k_pos = torch.stack([torch.randperm(S, generator=g), torch.where(torch.arange(S) < 100, torch.arange(S), -1)])
    pos = torch.tensor([[400], [99]])
    with torch.no_grad():
        expected = m.absorbed(q_nope, q_pe, c, pe, visible(pos, k_pos, None))
        got = m.absorbed_decode(q_nope, q_pe, c, pe, k_pos, pos, kernel)
    assert (got - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())
