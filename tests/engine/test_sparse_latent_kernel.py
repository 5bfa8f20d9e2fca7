"""DeepSeek Sparse Attention's decode through kernels/mla_decode.cpp's mla_decode_picked (the top-k latents read where
they lie in the cache) against the torch path: gather the picked rows, then MLA's absorbed attention over them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_kernels import built  # noqa: E402

from kvwall.engine.layers.attention import visible  # noqa: E402
from kvwall.engine.layers.latent import LatentAttention  # noqa: E402
from kvwall.engine.layers.latent_kernel import mla_decode_picked  # noqa: E402
from kvwall.spec.model import LatentAttention as LatentSpec  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    return built(mla_decode_picked, "mla_decode")


def layer(heads: int, rank: int, rope_dim: int, g) -> LatentAttention:
    m = LatentAttention(LatentSpec(heads, rank, None, 16, rope_dim, 16), hidden=32, index=0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


@pytest.mark.parametrize("heads,rank,rope_dim", [(12, 64, 16), (3, 20, 4)])
@pytest.mark.parametrize("picks", [1, 7, 300])
def test_picked_kernel_equals_gather_then_torch(kernel, heads, rank, rope_dim, picks):
    """Three rows of a cache of 400 blocks of 2 slots with a shuffled block table (the paged layout; a contiguous
    cache is one block of S slots per row): row 0 sees all its picks, row 1 holds only half of its slots (the rest
    are empty, position -1, or past its query), row 2 is a padding query (sees every pick). 300 picks: two chunks
    of 256; 3 heads: not a multiple of 4; widths not whole SIMD vectors."""
    g = torch.Generator().manual_seed(picks + heads)
    m = layer(heads, rank, rope_dim, g)
    B, bs, nb = 3, 2, 400
    S = nb * bs // B // bs * bs  # 266 slots a row
    pool_c, pool_pe = torch.randn(nb, bs, rank, generator=g), torch.randn(nb, bs, rope_dim + 5, generator=g)
    table = torch.randperm(nb, generator=g)[:B * (S // bs)].view(B, S // bs)  # (B, blocks a row)
    positions = torch.arange(S).expand(B, S).clone()
    positions[1, S // 2:] = -1  # row 1 holds S / 2 tokens
    pos = torch.tensor([[S - 1], [S // 2 - 1], [-1]])  # (B, 1)
    k = min(picks, S)
    top = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(B)])  # (B, k) slots
    top[1] = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(S - 1, generator=g)[:k - 1] + 1])  # sees 0
    rows = torch.arange(B)[:, None]
    k_pos = positions[rows, top]  # (B, k)
    q_nope, q_pe = torch.randn(B, 1, heads, 16, generator=g), torch.randn(B, 1, heads, rope_dim, generator=g)
    # the torch path: the picked rows gathered through the block table, then the absorbed attention
    blk, off = table[rows, top // bs], top % bs  # (B, k) each
    c, pe = pool_c[blk, off], pool_pe[blk, off, :rope_dim]  # (B, k, r), (B, k, dr)
    with torch.no_grad():
        expected = m.absorbed(q_nope, q_pe, c[:, None], pe[:, None], visible(pos, k_pos, None))  # (B, H, 1, dv)

        def picked(q, c_, pe_, kp, p, scale):
            return kernel(q, c_, pe_, table.contiguous(), top.contiguous(), kp, p, scale)

        # absorbed_decode reads c[:, 0], pe[:, 0]: the pools as (blocks, 1, bs, width) views, pe a strided slice
        got = m.absorbed_decode(q_nope, q_pe, pool_c[:, None], pool_pe[:, None, :, :rope_dim], k_pos, pos, picked)
    assert got.shape == expected.shape == (B, heads, 1, 16)
    assert (got - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())


def test_the_kernel_reads_only_the_picked_rows(kernel):
    """NaN in every slot but the picked ones changes nothing: the other rows are never read."""
    g = torch.Generator().manual_seed(0)
    m = layer(4, 32, 8, g)
    B, S, k = 2, 50, 5
    c, pe = torch.randn(B, 1, S, 32, generator=g), torch.randn(B, 1, S, 8, generator=g)
    top = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(B)])  # (B, k)
    rows = torch.arange(B)[:, None]
    k_pos, pos = top.clone(), torch.tensor([[S - 1], [S - 1]])
    q_nope, q_pe = torch.randn(B, 1, 4, 16, generator=g), torch.randn(B, 1, 4, 8, generator=g)

    def picked(q, c_, pe_, kp, p, scale):
        return kernel(q, c_, pe_, rows.contiguous(), top.contiguous(), kp, p, scale)

    with torch.no_grad():
        clean = m.absorbed_decode(q_nope, q_pe, c, pe, k_pos, pos, picked)
        poisoned_c, poisoned_pe = torch.full_like(c, float("nan")), torch.full_like(pe, float("nan"))
        poisoned_c[rows, 0, top], poisoned_pe[rows, 0, top] = c[rows, 0, top], pe[rows, 0, top]
        assert torch.equal(m.absorbed_decode(q_nope, q_pe, poisoned_c, poisoned_pe, k_pos, pos, picked), clean)
