"""A first prefill takes SDPA's causal kernel (banded blocks under a window shorter than the prompt) instead of
an explicit mask; it must give the masked result and must not be taken where the mask is anything else."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvwall.engine.caches import NoCache, make_cache  # noqa: E402
from kvwall.engine.layers.attention import attend_reference, prefix_start, visible  # noqa: E402
from kvwall.spec.model import MLP, Attention, Layer, ModelSpec  # noqa: E402

SPEC = ModelSpec("t", "llama", 32, 50, (Layer(Attention(6, 2, 16, 16), MLP(32)),))
LOCAL = ModelSpec("t", "mistral", 32, 50, (Layer(Attention(6, 2, 16, 16, 7), MLP(32)),))  # window 7


def qkv(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 6, T, 16, generator=g), torch.randn(B, 2, T, 16, generator=g),
            torch.randn(B, 2, T, 16, generator=g))


def cache_for(name: str, spec: ModelSpec, B: int):
    if name == "none":
        return NoCache()
    return make_cache(name, spec, B, 64, **({"residual": 8} if name.startswith("int") else {}))


@pytest.mark.parametrize("cache_name,spec", [("none", SPEC), ("contiguous", SPEC), ("int8:g8", SPEC), ("paged", SPEC),
                                             ("none", LOCAL), ("contiguous", LOCAL), ("sliding", LOCAL)])
def test_first_prefill_equals_the_masked_reference(cache_name, spec):
    """40 tokens; with LOCAL the window (7) is shorter than the prompt and the sliding cache is a ring whose
    (empty) slots come before the new tokens."""
    B, T = 2, 40
    window = spec.layers[0].mixer.window
    q, k, v = qkv(B, T)
    pos = torch.arange(T).expand(B, T)
    cache = cache_for(cache_name, spec, B)
    cache.step(pos)
    got = cache.attend(0, q, k, v, pos, 0.25, window, None)
    fresh = cache_for(cache_name, spec, B)
    fresh.step(pos)
    k_all, v_all, k_pos = fresh.update(0, k, v, pos)
    assert prefix_start(pos, k_pos) is not None  # the fast path was the one taken
    expected = attend_reference(q, k_all, v_all, visible(pos, k_pos, window), 0.25, None)
    assert (got - expected).abs().max().item() < 1e-5


def test_only_a_plain_causal_mask_takes_the_fast_path():
    T = 6
    first = torch.arange(T)[None]
    assert prefix_start(first, torch.arange(10)[None]) == 0  # empty slots after the prefix hold later positions
    assert prefix_start(first, torch.cat([first, torch.full((1, 4), -1)], 1)) == 0
    assert prefix_start(first, torch.cat([torch.full((1, 4), -1), first], 1)) == 4  # a ring's slots, then the new
    assert prefix_start(first + 3, torch.arange(10)[None]) is None  # a second chunk: it sees the past too
    assert prefix_start(first, torch.cat([torch.tensor([[2, -1, -1, -1]]), first], 1)) is None  # a held position
    padded = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]])
    assert prefix_start(padded, torch.arange(6)[None]) is None  # a right-padded row
    assert prefix_start(first, torch.tensor([[0, 1, 2, 3, 4, 5, 2, -1]])) is None  # a slot repeats a position
    assert prefix_start(first[:, :1], torch.arange(4)[None]) is None  # decode keeps its own path


@pytest.mark.parametrize("T", [1, 7])
def test_a_value_head_narrower_than_the_key_head_is_exact(T):
    """MLA's naive path attends with 96-wide q/k and 64-wide v; SDPA gets v zero-padded, then sliced."""
    from kvwall.engine.layers.attention import attend, attend_causal

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, T, 24, generator=g), torch.randn(2, 4, 9, 24, generator=g)
    v = torch.randn(2, 4, 9, 8, generator=g)
    pos = torch.arange(9 - T, 9).expand(2, T)
    mask = visible(pos, torch.arange(9)[None], None)
    expected = attend_reference(q, k, v, mask, 0.2, None)
    got = attend(q, k, v, mask, 0.2, None)
    assert got.shape == (2, 4, T, 8) and (got - expected).abs().max().item() < 1e-5
    square = attend_causal(q[:, :, -T:], k[:, :, :T], v[:, :, :T], 0.2)  # no window
    first = torch.arange(T)[None]
    causal = attend_reference(q[:, :, -T:], k[:, :, :T], v[:, :, :T], visible(first, first, None), 0.2, None)
    assert (square - causal).abs().max().item() < 1e-5
