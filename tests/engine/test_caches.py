"""Every cache's bytes equal the predictor's; lossy caches stay within their stated bound; paging never leaks."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_checkpoints import VOCAB, WINDOW  # noqa: E402

from kvwall.engine.caches import ContiguousCache, PagedCache, QuantizedCache, SlidingCache, make_cache  # noqa: E402
from kvwall.engine.caches.paged import BlockManager  # noqa: E402
from kvwall.engine.caches.quant import dequantize, group_size, quantize  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.predict.memory import Formats, kivi_cache_bytes, memory  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402
from kvwall.spec.model import MLP, Attention, Layer, ModelSpec  # noqa: E402


def spec_of(windows=(None, 8, None), kv=2, d=16, dv=16):
    layers = tuple(Layer(Attention(4, kv, d, dv, w), MLP(32)) for w in windows)
    return ModelSpec("t", "llama", 32, 50, layers)


def fmts(kv: str) -> Formats:
    return Formats(get_format("fp32"), get_format(kv), get_format("fp32"))


def feed(cache, spec, lengths, chunk=7, seed=0):
    """Write random K/V for rows of the given lengths, `chunk` tokens per step (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    B, done = len(lengths), [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        T = chunk
        pos = torch.full((B, T), -1)
        for b in range(B):
            n = min(T, lengths[b] - done[b])
            pos[b, :n] = torch.arange(done[b], done[b] + n)
            done[b] += n
        cache.step(pos)
        for i, layer in enumerate(spec.layers):
            a = layer.mixer
            k, v = (torch.randn(B, a.n_kv_heads, T, a.head_dim, generator=g),
                    torch.randn(B, a.n_kv_heads, T, a.v_head_dim, generator=g))
            cache.update(i, k, v, pos)


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_contiguous_bytes_equal_predictor(dtype, fmt):
    spec = spec_of()
    cache = ContiguousCache(spec, 3, 50, dtype)
    expected = memory(spec.with_window(None), batch=3, context=50, formats=fmts(fmt)).cache_bytes
    assert cache.nbytes() == expected == 3 * 50 * 3 * 2 * 2 * 16 * cache.layers[0].k.element_size()


@pytest.mark.parametrize("max_len", [5, 8, 50, 300])
def test_sliding_bytes_equal_predictor_and_stop_at_the_window(max_len):
    spec = spec_of(windows=(8, None, 8))
    cache = SlidingCache(spec, 2, max_len)
    assert cache.nbytes() == memory(spec, batch=2, context=max_len, formats=fmts("fp32")).cache_bytes
    local = spec_of(windows=(8, 8, 8))
    assert SlidingCache(local, 2, max_len).nbytes() == SlidingCache(local, 2, 10_000).nbytes() or max_len < 8


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "int8:g32", "int4:g16:sym"])
@pytest.mark.parametrize("length", [3, 31, 32, 63, 64, 100, 257])
def test_quantized_bytes_equal_predictor(fmt, length):
    spec = spec_of(d=32, dv=16)
    f = get_format(fmt)
    cache = QuantizedCache(spec, 2, 300, f, residual=32)
    feed(cache, spec, [length, length])
    expected = kivi_cache_bytes(spec.with_window(None), batch=2, context=length, kv=f, residual=32,
                                residual_format=get_format("fp32"))
    assert cache.nbytes() == expected
    if length >= 32 + f.group:  # something was quantized: fewer bytes than fp32
        fp32_bytes = memory(spec.with_window(None), batch=2, context=length, formats=fmts("fp32")).cache_bytes
        assert cache.nbytes() < fp32_bytes


@pytest.mark.parametrize("block", [1, 4, 16])
def test_paged_bytes_equal_predictor_for_mixed_lengths(block):
    spec = spec_of()
    lengths = [1, 17, 40, 5]
    cache = PagedCache(spec, len(lengths), block, max_len=64)
    feed(cache, spec, lengths)
    flat = spec.with_window(None)
    allocated = sum(memory(flat, batch=1, context=n, formats=fmts("fp32"), block_size=block).cache_bytes
                    for n in lengths)
    used = sum(memory(flat, batch=1, context=n, formats=fmts("fp32")).cache_bytes for n in lengths)
    assert cache.nbytes() == allocated
    assert cache.used_bytes() == used
    assert cache.blocks.allocated_blocks() == sum(-(-n // block) for n in lengths)
    assert 0 <= cache.nbytes() - cache.used_bytes() < len(lengths) * cache.block_bytes()


def test_quantization_round_trip_is_within_half_a_step():
    x = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(0))
    for name in ("int8", "int4", "int2", "int4:g16:sym"):
        f = get_format(name)
        g = group_size(f, 64)
        q, s, z = quantize(x, f, g)
        assert q.dtype == torch.uint8 and q.shape[-1] == 64 * f.bits // 8 and s.shape[-1] == 64 // g
        err = (dequantize(q, s, z, f, g) - x).abs().reshape(4, 6, -1, g)
        bound = s.float()[..., None] * 0.5 + 1e-3 * x.abs().max()  # half a step + fp16 rounding of scale/zero
        assert (err <= bound).all(), name


# Lossy caches, stated bounds: decode with KIVI (residual 8, groups of 8 tokens) against the exact full
# forward, 48 positions, tiny random models (logits of magnitude ~3-5). Measured max |dlogit| / max KL:
#   llama   int8 0.008 / 4e-6   int4 0.10 / 5e-4   int2 0.50 / 0.02
#   gemma3  int8 0.075 / 3e-4   int4 0.92 / 0.06   int2 3.4  / 0.51  (larger keys: (1 + w) q/k norms, 24^-0.5 scale)
# Each step of 2 bits multiplies the error by ~4-16 (int8 -> int4: step 255/15 = 17x coarser).
# The bounds below are 2.1-2.7x the logit errors and 2.4-5x the KLs measured above.
BOUNDS = {("llama", "int8:g8"): (0.02, 2e-5), ("llama", "int4:g8"): (0.25, 2e-3), ("llama", "int2:g8"): (1.2, 0.06),
          ("gemma3_text", "int8:g8"): (0.2, 1e-3), ("gemma3_text", "int4:g8"): (2.0, 0.15),
          ("gemma3_text", "int2:g8"): (7.0, 1.2)}


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt", list(BOUNDS))
def test_quantized_decode_error_is_bounded(family, fmt, checkpoint):
    path, _ = checkpoint(family)
    model = load_model(path)
    x = torch.randint(0, VOCAB, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(2))
    B, T = x.shape
    with torch.no_grad():
        full = model(x)
        cache = make_cache(fmt, model.spec, B, T, residual=8)
        steps = [model(x[:, :4], None, cache)] + [model(x[:, t:t + 1], torch.full((B, 1), t), cache)
                                                 for t in range(4, T)]
    got = torch.cat(steps, 1)
    max_err, max_kl = BOUNDS[family, fmt]
    kl = (full.log_softmax(-1).exp() * (full.log_softmax(-1) - got.log_softmax(-1))).sum(-1)  # (B, T)
    assert cache.layers[0].chunks == [(T - 8) // 8] * B  # most tokens really were quantized
    assert (got - full).abs().max().item() < max_err
    assert kl.max().item() < max_kl
    assert (got[:, :8] - full[:, :8]).abs().max().item() < 1e-4  # inside the residual: exact


@pytest.mark.slow
def test_quantized_batch_equals_one_by_one(checkpoint):
    path, _ = checkpoint("qwen3")
    model = load_model(path)
    prompts = [[5, 6, 7], list(range(40, 70)), [9] * 12]
    batch = generate(model, prompts, max_new_tokens=24, cache="int4:g8", residual=8).tokens
    alone = [generate(model, [p], max_new_tokens=24, cache="int4:g8", residual=8).tokens[0] for p in prompts]
    assert batch == alone


def test_paged_random_workload_never_leaks_or_shares_blocks():
    """Rows start and finish at random; after every step the tables are disjoint and each live row
    reads back exactly the K it wrote; at the end every block is free again."""
    spec = spec_of(windows=(None,))
    rows, block = 4, 4
    cache = PagedCache(spec, rows, block, n_blocks=40)
    rng = random.Random(0)
    written: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    live = [False] * rows
    for _ in range(150):
        pos = torch.full((rows, 3), -1)
        for r in range(rows):
            if live[r] and rng.random() < 0.15:
                cache.release(r)
                live[r], written[r] = False, []
            elif not live[r] and rng.random() < 0.5:
                live[r] = True
            if live[r] and len(written[r]) < 30:
                n = rng.randint(1, 3)
                pos[r, :n] = torch.arange(len(written[r]), len(written[r]) + n)
        cache.step(pos)
        k = torch.randn(rows, 2, 3, 16)
        k_all, _, k_pos = cache.update(0, k, k.clone(), pos)
        cache.blocks.check()
        for r in range(rows):
            n = int((pos[r] >= 0).sum())
            written[r].extend(k[r, :, t] for t in range(n))
            held = k_all[r][:, k_pos[r] >= 0]  # (H, len, D)
            assert held.shape[1] == len(written[r])
            if written[r]:
                assert torch.equal(held, torch.stack(written[r], 1))
        assert cache.nbytes() == cache.blocks.allocated_blocks() * cache.block_bytes()
    for r in range(rows):
        cache.release(r)
    assert len(cache.blocks.free) == 40 and cache.nbytes() == 0


def test_block_manager_out_of_blocks_is_an_error():
    bm = BlockManager(3, 4, 2)
    bm.grow(0, 8)
    with pytest.raises(KvwallError, match="out of blocks"):
        bm.grow(1, 5)
    bm.release(0)
    bm.grow(1, 12)
    assert bm.allocated_blocks() == 3 and not bm.free


def test_unknown_cache_name():
    with pytest.raises(KvwallError, match="unknown cache 'ring'.*contiguous, sliding, fp8, int8, int4, int2, paged"):
        make_cache("ring", spec_of(), 1, 8)
