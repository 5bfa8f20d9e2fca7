"""serve's paged pools read in place at a decode step (kernels/paged_decode.cpp): integer pools (int8 / int4 / int2,
with and without :sym) through paged_decode_int, bf16 / fp16 / fp8 pools through paged_decode, each equal to the
gather-and-dequantize path over the same pool (KVCache.attend: caches/quant.py's dequantize, then SDPA), also where a
long row alone is cut along its tokens, and a served stream's greedy tokens the same with the kernel on and off."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from native_kernels import built  # noqa: E402

from kvwall.engine.caches.base import KVCache  # noqa: E402
from kvwall.engine.caches.paged_kernel import paged_decode, paged_decode_int  # noqa: E402
from kvwall.engine.caches.quant import quantize  # noqa: E402
from kvwall.serve import runner as runner_mod  # noqa: E402
from kvwall.serve.runner import QuantizedPages, Runner, make_pool  # noqa: E402
from kvwall.serve.scheduler import Request  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402

BS = 16  # tokens a block


@pytest.fixture(scope="module")
def kernels():
    return built(paged_decode, "paged_decode"), built(paged_decode_int, "paged_decode")


def spec(n_q: int, n_kv: int, d: int, window=None):
    """One attention layer: n_q query heads over n_kv KV heads of d channels."""
    cfg = {"model_type": "llama", "hidden_size": n_q * d, "num_hidden_layers": 1, "num_attention_heads": n_q,
           "num_key_value_heads": n_kv, "head_dim": d, "intermediate_size": 64, "vocab_size": 32,
           "max_position_embeddings": 4096}
    if window:
        cfg.update(model_type="mistral", sliding_window=window)
    return spec_from_config(cfg, name="tiny")


def fill(pool, g: torch.Generator) -> None:
    """Every slot of the pool holds something (unread slots must stay unread): random K/V, quantized as the pool
    stores them, or rounded to its float dtype."""
    if isinstance(pool, QuantizedPages):
        for gs, parts in pool.pools[0]:
            n, h, bs, _ = parts[1].shape
            x = torch.randn(n, h, bs, parts[1].shape[3] * gs, generator=g) * 2 + 0.5  # off-centre: zeros matter
            for part, value in zip(parts, quantize(x, pool.fmt, gs)):
                part.copy_(value)
    else:
        for p in pool.pools[0]:
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))


def decode_step(kv, n_q, n_kv, d, lengths, window, seed):
    """A pool of `kv` whose rows hold `lengths` tokens in blocks scattered through it in shuffled order, each row's
    new token its last -> (in-place attention, gathered attention, the pool), (B, Hq, 1, D) each."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lengths]
    n_blocks = sum(need) + 3
    pool = make_pool(spec(n_q, n_kv, d, window), BS, n_blocks, kv, "cpu")
    fill(pool, g)
    order = torch.randperm(n_blocks, generator=g).tolist()
    tables = [order[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lengths))]
    pool.plan(tables, lengths)
    pos = torch.tensor([[n - 1] for n in lengths])  # (B, 1)
    pool.step(pos)
    assert pool.decoding
    B = len(lengths)
    q = torch.randn(B, n_q, 1, d, generator=g)  # (B, Hq, 1, D)
    k, v = torch.randn(B, n_kv, 1, d, generator=g), torch.randn(B, n_kv, 1, d, generator=g)  # (B, Hkv, 1, D)
    got = pool.attend(0, q, k, v, pos, d ** -0.5, window, None)  # in place, after writing k, v
    expected = KVCache.attend(pool, 0, q, k, v, pos, d ** -0.5, window, None)  # gather, dequantize, SDPA
    return got, expected


INT_FORMATS = ["int8", "int8:sym", "int4", "int4:sym", "int4:g16", "int2", "int2:sym"]


@pytest.mark.parametrize("kv", INT_FORMATS)
@pytest.mark.parametrize("n_q, n_kv", [(2, 2), (6, 2)])  # GQA rep 1 and 3
@pytest.mark.parametrize("window", [None, 5, 40])
def test_integer_pool_in_place_equals_the_gather(kernels, kv, n_q, n_kv, window):
    """Rows of 1, 17, 33 and 200 tokens (on and off the block edge, one token, many blocks), head_dim 64: int8 is
    one group of 64 a vector, int4 two of 32 (int4:g16 four), int2 two of 32."""
    got, expected = decode_step(kv, n_q, n_kv, 64, [1, 17, 33, 200], window, seed=len(kv) + n_q + (window or 0))
    assert got.shape == expected.shape == (4, n_q, 1, 64)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv", ["int8:g8", "int4:g8"])
def test_groups_narrower_than_a_simd_vector(kernels, kv):
    """head_dim 40 in groups of 8: neither the group nor the vector is a whole number of 16-float SIMD vectors."""
    got, expected = decode_step(kv, 6, 2, 40, [3, 16, 70], 24, seed=5)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("window", [None, 5])
def test_float_pools_in_place_equal_the_gather(kernels, kv, window):
    """bf16 / fp16 / fp8 (e4m3) pools under an fp32 query: the kernel converts each block's run of tokens exactly
    (bf16 a 16-bit shift, fp16 cvtph, fp8 e4m3_to_float), so it equals the gather that converts with torch."""
    got, expected = decode_step(kv, 6, 2, 40, [1, 17, 33, 200], window, seed=11 + (window or 0))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("window", [None, 700])
def test_a_long_row_alone_is_cut_along_its_tokens(kernels, kv, window):
    """Batch 1, one KV head read by 3 query heads, 1,500 tokens (or the last 700): a single (row, KV head) job, which
    the kernel cuts into pieces of at least 256 tokens (common.h's cut_jobs) and whose softmax sums it merges: equal
    to the gather's attention over the whole row."""
    got, expected = decode_step(kv, 3, 1, 64, [1500], window, seed=3 + (window or 0))
    assert got.shape == (1, 3, 1, 64)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_the_kernel_reads_the_codes_the_gather_dequantizes(kernels):
    """A hand-made int8:g8:sym pool: one row of 2 tokens, one KV head of 8 channels, one group. Token 0 sits in
    block 1, slot 0: codes 128 + [1, 0, ...] at scale 1, so k = v = e0. Token 1 is the step's own, k = v = e1,
    quantized on write to code 255 at scale fp16(1 / 127), so it reads back as s1 = 127 fp16(1 / 127) e1.
    q = (ln 3) e0 at scale 1: scores ln 3 and 0, weights 3/4 and 1/4, y = 0.75 e0 + 0.25 s1 e1."""
    import math

    pool = QuantizedPages(spec(1, 1, 8), BS, 2, get_format("int8:g8:sym"))
    (_, kparts), (_, vparts) = pool.pools[0]
    for parts in (kparts, vparts):
        parts[0][1, 0, 0] = torch.tensor([129] + [128] * 7, dtype=torch.uint8)
        parts[1][1, 0, 0] = 1.0
    pool.plan([[1]], [2])
    pos = torch.tensor([[1]])
    pool.step(pos)
    e1 = torch.zeros(1, 1, 1, 8)
    e1[..., 1] = 1.0
    q = torch.zeros(1, 1, 1, 8)
    q[..., 0] = math.log(3)
    y = pool.attend(0, q, e1, e1, pos, 1.0, None, None)  # (1, 1, 1, 8)
    s1 = 127 * float(torch.tensor(1 / 127, dtype=torch.float16))
    expected = torch.zeros(8)
    expected[0], expected[1] = 0.75, 0.25 * s1
    torch.testing.assert_close(y.flatten(), expected, rtol=1e-6, atol=1e-6)
    assert int(kparts[0][1, 0, 1, 1]) == 255 and int(kparts[0][1, 0, 1, 0]) == 128  # token 1 written in place


def test_steps_the_kernel_does_not_take_gather(kernels, monkeypatch):
    """in_place False (the reference), a softcap, or a prefill chunk: the gather, never the kernel; and the fused
    decode step is handed the pool at a decode step only, and never with in_place False."""
    monkeypatch.setattr(runner_mod, "attend_int_blocks", lambda *a: pytest.fail("the kernel ran"))
    pool = make_pool(spec(2, 2, 64), BS, 4, "int8", "cpu")
    pool.plan([[0, 1]], [20])
    pool.step(torch.arange(20)[None])
    assert not pool.decoding and pool.decode_blocks(1) is None  # a prefill chunk
    q, k = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64)
    assert pool.attend(0, q, k, k, torch.arange(20)[None], 0.125, None, None).shape == (1, 2, 20, 64)
    pool.plan([[0, 1]], [21])
    pos = torch.tensor([[20]])
    pool.step(pos)
    assert pool.decoding and pool.decode_blocks(1) is not None
    q, k = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    pool.attend(0, q, k, k, pos, 0.125, None, 30.0)  # a softcap
    pool.in_place = False
    assert pool.decode_blocks(1) is None
    pool.attend(0, q, k, k, pos, 0.125, None, None)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["int8", "int4:g8", "int2:g8:sym", "bf16", "fp8"])
def test_served_tokens_are_the_same_with_the_kernel_on_and_off(tiny_model, kv, monkeypatch):
    """Tiny llama (4 query heads over 2 KV heads of 16, 3 layers): four prompts of 5-38 tokens arriving one a step,
    greedy, blocks of 4 (rows cross many blocks), chunks of 16; the kernel on, then off (gather and dequantize):
    the same tokens, and the kernel ran in every layer of the decode forwards (and never with it off)."""
    from kvwall.engine import decode_stack
    from kvwall.engine.caches import paged

    _, model = tiny_model("llama")
    calls = []
    real_int, real_float = runner_mod.attend_int_blocks, paged.attend_blocks
    monkeypatch.setattr(runner_mod, "attend_int_blocks", lambda *a: calls.append(1) or real_int(*a))
    monkeypatch.setattr(paged, "attend_blocks", lambda *a: calls.append(1) or real_float(*a))
    real_stack = decode_stack.DecodeStack.__call__

    def stack(self, *a):  # an fp8 pool's decode step runs fused (every layer in place in one call): 3 layers read
        y = real_stack(self, *a)
        calls.extend([1, 1, 1] if y is not None else [])
        return y

    monkeypatch.setattr(decode_stack.DecodeStack, "__call__", stack)
    out = {}
    for on in (True, False):
        runner = Runner(model, n_blocks=48, block_size=4, chunk=16, kv_dtype=kv)
        runner.cache.in_place = on
        reqs = [Request(i, [(5 * i + 7 * j + 1) % 160 for j in range(5 + 11 * i)], 12) for i in range(4)]
        pending = list(enumerate(reqs))
        steps = 0
        while pending or runner.sched.has_work():
            while pending and pending[0][0] <= steps:
                runner.add(pending.pop(0)[1])
            runner.step()
            steps += 1
        out[on] = [r.out for r in reqs]
        assert (len(calls) > 0 and len(calls) % 3 == 0) if on else not calls  # 3 layers a decode forward
        calls.clear()
    assert out[True] == out[False] and all(len(o) == 12 for o in out[True])
