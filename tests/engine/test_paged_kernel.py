"""Decode attention read in place from the paged pool (C++) equals the gather path over the same pool."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_kernels import built  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.caches.base import KVCache  # noqa: E402
from kvwall.engine.caches.paged import PagedCache  # noqa: E402
from kvwall.engine.caches.paged_kernel import paged_decode  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.model import Transformer  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    return built(paged_decode, "paged_decode")


def spec(window=None):
    """One GQA layer: 6 query heads over 2 KV heads (3 a group) of 40 channels (not a whole SIMD vector)."""
    cfg = {"model_type": "llama", "hidden_size": 240, "num_hidden_layers": 1, "num_attention_heads": 6,
           "num_key_value_heads": 2, "head_dim": 40, "intermediate_size": 64, "vocab_size": 32,
           "max_position_embeddings": 512}
    if window:
        cfg.update(model_type="mistral", sliding_window=window)
    return spec_from_config(cfg, name="tiny")


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("lengths", [[1, 17, 33], [200, 16, 48], [5]])
def test_in_place_decode_equals_the_gather(kernel, window, lengths):
    """Rows of different lengths (on and off the block edge, one token, several blocks) in blocks scattered
    through the pool in shuffled order; the query of each row is its last token; with and without a window."""
    g = torch.Generator().manual_seed(sum(lengths) + (window or 0))
    bs, B = 16, len(lengths)
    need = [-(-n // bs) for n in lengths]
    pool = PagedCache(spec(window), batch=B, block_size=bs, n_blocks=sum(need) + 3)
    order = torch.randperm(sum(need) + 3, generator=g).tolist()  # blocks in no particular order
    pool.blocks.free.clear()
    pool.blocks.free.extend(order)
    kp, vp = pool.pools[0]
    kp.copy_(torch.randn(kp.shape, generator=g))  # every slot holds something: unread slots must stay unread
    vp.copy_(torch.randn(vp.shape, generator=g))
    pos = torch.tensor([[n - 1] for n in lengths])  # (B, 1): each row's new token is its last
    pool.step(pos)
    assert pool.decoding and [len(t) for t in pool.blocks.tables] == need
    q = torch.randn(B, 6, 1, 40, generator=g)  # (B, Hq, 1, D)
    k, v = torch.randn(B, 2, 1, 40, generator=g), torch.randn(B, 2, 1, 40, generator=g)
    got = pool.attend(0, q, k, v, pos, 40 ** -0.5, window, None)  # in place (writes k, v first)
    expected = KVCache.attend(pool, 0, q, k, v, pos, 40 ** -0.5, window, None)  # gather, then SDPA
    assert got.shape == expected.shape == (B, 6, 1, 40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_prefill_and_padding_rows_take_the_gather(kernel):
    """Only a step where every row adds its last token reads in place; a prefill chunk or a padding row does not."""
    pool = PagedCache(spec(), batch=2, block_size=4, n_blocks=8)
    pool.step(torch.tensor([[0, 1, 2], [0, 1, -1]]))
    assert not pool.decoding
    pool.step(torch.tensor([[3], [-1]]))
    assert not pool.decoding
    pool.step(torch.tensor([[4], [2]]))
    assert pool.decoding


def test_generate_over_the_paged_cache_equals_the_contiguous_cache(kernel):
    """A tiny GQA model's greedy decode over the paged pool (decode steps in place) equals a contiguous cache's,
    and a decode step's logits over the pool equal a full forward over the whole sequence."""
    torch.manual_seed(0)
    s = spec()
    model = Transformer(s).eval()
    prompts = [torch.randint(0, 32, (7,)).tolist(), torch.randint(0, 32, (19,)).tolist()]
    out = {name: generate(model, prompts, 20, cache=name, stop=()).tokens for name in ("paged", "contiguous")}
    assert out["paged"] == out["contiguous"] and all(len(t) == 20 for t in out["paged"])
    seq = torch.tensor([prompts[1] + out["paged"][1]])  # (1, 39)
    with torch.no_grad():
        full = model(seq)[:, -1]  # (1, V): the last token's logits from scratch
        cache = make_cache("paged", s, 1, 64)
        model(seq[:, :-1], cache=cache)
        step = model(seq[:, -1:], torch.tensor([[seq.shape[1] - 1]]), cache=cache)[:, -1]  # one step, in place
        assert cache.decoding
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
def test_contiguous_decode_in_place_equals_sdpa_and_a_full_forward(kernel, window, monkeypatch, two_threads):
    """A contiguous cache's decode step (every row at one position) goes through the kernel, one block per row:
    its logits equal the SDPA path's (kernel off) and, for the last token, a full forward from scratch."""
    from kvwall.engine.caches import contiguous

    torch.manual_seed(1)
    s = spec(window)
    model = Transformer(s).eval()
    model.stack = False  # layer by layer (the fused decode step writes and reads the cache itself)
    seq = torch.randint(0, 32, (3, 23))  # (B, T): three rows, the same length
    calls = []

    def steps() -> torch.Tensor:
        with torch.no_grad():
            cache = make_cache("contiguous", s, 3, 32)
            model(seq[:, :9], cache=cache)
            out = [model(seq[:, t:t + 1], torch.full((3, 1), t), cache=cache)[:, -1] for t in range(9, 23)]
        return torch.stack(out, 1)  # (B, 14, V)

    real = contiguous.in_place_kernel
    monkeypatch.setattr(contiguous, "in_place_kernel", lambda *a: calls.append(1) or real(*a))
    fast = steps()  # 3 rows x 2 KV heads on 2 threads: a job per thread
    assert len(calls) == 14 * s.n_layers  # every decode step of every layer asked for it
    monkeypatch.setattr(contiguous, "in_place_kernel", lambda *a: None)
    torch.testing.assert_close(fast, steps(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        full = model(seq)[:, -1]  # (B, V)
    torch.testing.assert_close(fast[:, -1], full, rtol=1e-4, atol=1e-4)


def test_contiguous_decode_leaves_one_kv_head_to_sdpa(kernel, monkeypatch, two_threads):
    """Fewer (row, KV head) jobs than threads (MQA at batch 1): SDPA, which splits the sequence, not the kernel."""
    from kvwall.engine.caches import contiguous

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 32, "max_position_embeddings": 64}
    s = spec_from_config(cfg, name="mqa")
    model = Transformer(s).eval()
    calls = []
    monkeypatch.setattr(contiguous, "in_place_kernel", lambda *a: calls.append(1))
    with torch.no_grad():
        cache = make_cache("contiguous", s, 1, 16)
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        model(torch.tensor([[4]]), torch.tensor([[3]]), cache=cache)
    assert calls == []


def test_sliding_ring_decode_in_place_equals_sdpa(kernel, monkeypatch, two_threads):
    """A ring (window 5, no sinks) read in place by the kernel, its slots in rotated order, gives the logits of
    the SDPA path with the window's mask, before the ring fills and long after it wraps."""
    from kvwall.engine.caches import contiguous

    torch.manual_seed(2)
    s = spec(window=5)
    model = Transformer(s).eval()
    model.stack = False  # the layer-by-layer step (the fused one's rings: test_decode_stack.py)
    seq = torch.randint(0, 32, (3, 20))  # (B, T)
    calls = []

    def steps() -> torch.Tensor:
        with torch.no_grad():
            cache = make_cache("sliding", s, 3, 32)
            model(seq[:, :3], cache=cache)  # 3 tokens: the ring is not full yet
            out = [model(seq[:, t:t + 1], torch.full((3, 1), t), cache=cache)[:, -1] for t in range(3, 20)]
        return torch.stack(out, 1)  # (B, 17, V)

    real = contiguous.in_place_kernel
    monkeypatch.setattr(contiguous, "in_place_kernel", lambda *a: calls.append(1) or real(*a))
    fast = steps()
    assert len(calls) == 17 * s.n_layers
    monkeypatch.setattr(contiguous, "in_place_kernel", lambda *a: None)
    torch.testing.assert_close(fast, steps(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        full = model(seq)[:, -1]  # (B, V): the window's mask over the whole sequence
    torch.testing.assert_close(fast[:, -1], full, rtol=1e-4, atol=1e-4)
