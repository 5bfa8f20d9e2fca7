"""The fp8 and KIVI (int8 / int4 / int2) caches inside the fused decode step (engine/decode_stack.py): its logits
equal the layer-by-layer path's over the same cache, at batch 1 and at batch 3 with prompts of different lengths,
across the KIVI chunk flushes (the chunk a step would flush quantized first: every step is the stack's, but with
R = 0); long rows cut into pieces; and the e4m3 conversions its
kernel reads and writes with, against torch's own float8_e4m3fn."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.caches.quantized import QuantizedCache, QuantizedLayer  # noqa: E402
from kvwall.engine.model import Transformer  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("two_threads")  # conftest.py: 2 threads, as CI has

MODELS = {
    "llama": {},  # GQA: 4 query heads of 12 over 2 KV heads, SwiGLU
    "gemma3_text": {"head_dim": 12, "query_pre_attn_scalar": 10, "sliding_window": 6},  # (1 + w) norms, q/k norms,
    # sandwich norms, GeGLU (tanh), a 6-token window on 5 of every 6 layers (the KIVI cache keeps every token: masks)
}
RESIDUAL = 4  # a small residual R, so that short prompts reach the first chunk flush soon


def model(model_type: str, layers: int = 7, **extra) -> Transformer:
    cfg = {"model_type": model_type, "hidden_size": 48, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 40, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-6, **MODELS[model_type], **extra}
    torch.manual_seed(0)
    m = Transformer(spec_from_config(cfg, name="tiny"))
    for p in m.parameters():
        p.data.normal_(0, 0.3)
    return m.set_eager(False)


def decode(m: Transformer, prompts: list[torch.Tensor], steps: int, cache: str, residual: int = RESIDUAL):
    """Right-padded prefill of `prompts` into two caches, then `steps` greedy steps, each row at its own next position:
    every step runs once through the stack over one cache and once layer by layer over the other, after the first is
    made a copy of the second (so each step starts both paths from the same state: what a step adds, not what the
    steps before it accumulated; a KIVI flush rounds values that differ in their last bits, and a code or fp16 scale
    that flips there moves later logits by up to the format's step). -> (logits of each step through the stack and
    layer by layer (B, steps, V) x2, the stack's cache, the layers' cache, each step's cache writes close)."""
    B, T = len(prompts), max(len(p) for p in prompts)
    tok, pos = torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1)
    for b, p in enumerate(prompts):
        tok[b, :len(p)], pos[b, :len(p)] = p, torch.arange(len(p))
    stack_cache, layer_cache = (make_cache(cache, m.spec, B, T + steps + 1, residual=residual) for _ in range(2))
    m.stack = False
    with torch.inference_mode():
        nxt = m(tok, pos, layer_cache, last_only=True)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        got, expected = [], []
        m.stack = None  # built at the first step, then kept
        for i in range(steps):
            at = torch.tensor([[len(p) + i] for p in prompts])  # (B, 1): each row's end
            copy_cache(stack_cache, layer_cache)
            got.append(m(nxt, at, stack_cache))  # (B, 1, V)
            built, m.stack = m.stack, False
            expected.append(m(nxt, at, layer_cache))
            m.stack = built
            writes_close(stack_cache, layer_cache)
            nxt = expected[-1][:, -1].argmax(-1, keepdim=True)
    m.stack = None
    return torch.cat(got, 1), torch.cat(expected, 1), stack_cache, layer_cache


def copy_cache(dst, src) -> None:
    """dst's buffers and counters made src's, in place (the buffers the stack holds views of stay the same)."""
    for a, b in zip(dst.layers, src.layers):
        for name in ("k", "v", "kq", "ks", "kz", "vq", "vs", "vz", "rk", "rv"):
            if getattr(a, name, None) is not None:
                getattr(a, name).copy_(getattr(b, name))
        if isinstance(a, QuantizedLayer):
            a.chunks[:], a.res[:] = b.chunks, b.res


def writes_close(a_cache, b_cache) -> None:
    """The step's writes: KIVI residuals (the same counters, values to float-sum order) or fp8 bytes (equal but for a
    rare value at a rounding boundary: then one e4m3 step, 1/8 of it at most)."""
    for a, b in zip(a_cache.layers, b_cache.layers):
        if isinstance(a, QuantizedLayer):
            assert a.chunks == b.chunks and a.res == b.res
            torch.testing.assert_close(a.rk, b.rk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.rv, b.rv, rtol=1e-5, atol=1e-5)
        elif a.k.dtype == torch.float32:  # the contiguous cache: the same new rows
            torch.testing.assert_close(a.k, b.k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.v, b.v, rtol=1e-5, atol=1e-5)
        else:
            assert a.k.dtype == torch.float8_e4m3fn
            for x, y in ((a.k, b.k), (a.v, b.v)):
                assert (x.view(torch.uint8) != y.view(torch.uint8)).sum() <= 2
                torch.testing.assert_close(x.float(), y.float(), rtol=0.07, atol=2 ** -9)


def flushes(n: int, group: int) -> bool:
    """Whether the token that makes a row hold n tokens flushes a chunk (the KIVI layout by hand: the residual holds
    every token up to R + G - 1, then a chunk of G leaves it each time it would reach R + G)."""
    return n >= RESIDUAL + group and (n - RESIDUAL) % group == 0


CASES = [("int8", 128), ("int4", 32), ("int2", 32), ("int4:g64", 64), ("int4:sym", 32)]  # group: the formats' own


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("lengths", [[7], [5, 40, 19]])
@pytest.mark.parametrize("fmt,group", CASES)
def test_kivi_in_the_stack_equals_the_layers(kernel, stacked, model_type, lengths, fmt, group):
    """2G + 3 steps: two flushes per row, each chunk quantized before the stack's step; every step in the stack."""
    assert get_format(fmt).group == group
    m = model(model_type, layers=6 if model_type == "gemma3_text" else 3)  # Gemma 3: layer 5 is its global one
    g = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(0, 40, (n,), generator=g) for n in lengths]
    steps = 2 * group + 3
    got, expected, c_stack, c_layers = decode(m, prompts, steps, fmt)
    assert stacked == [True] * steps
    assert sum(flushes(n + i + 1, group) for n in lengths for i in range(steps)) >= 2 * len(lengths)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.abs().max() > 1  # not a degenerate model
    assert isinstance(c_stack, QuantizedCache)
    for layer in c_stack.layers:  # the Python counters followed the kernel's writes: by hand
        assert layer.chunks == [(n + steps - RESIDUAL) // group for n in lengths]
        assert layer.res == [RESIDUAL + (n + steps - RESIDUAL) % group for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("lengths", [[6], [3, 17, 9]])
def test_fp8_in_the_stack_equals_the_layers(kernel, stacked, model_type, lengths):
    """Every step in the stack, rows at their own positions; the bytes it wrote are the layers' bytes."""
    m = model(model_type)
    g = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(0, 40, (n,), generator=g) for n in lengths]
    got, expected, _, _ = decode(m, prompts, 12, "fp8")
    assert stacked == [True] * 12
    # 1e-4, not 1e-5: the step's new K/V is rounded to e4m3 on both paths, and a value within an fp32 rounding of a
    # boundary can take the neighbouring code on one of them (writes_close allows it); the step then reads that value
    # one e4m3 step off. On an AVX2-only host (2026-12-07: 8-lane sums) that moved a logit of [6]-llama by 5.6e-5.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert got.abs().max() > 1


def test_with_no_residual_a_flushing_step_is_left_to_the_layers(kernel, stacked):
    """R = 0: the chunk a step flushes holds that step's own token, which only the layers have (int4, G = 32: a
    prompt of 30 tokens flushes at the 32nd token, the second step)."""
    m = model("llama", layers=2)
    prompt = torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(3))
    got, expected, c_stack, _ = decode(m, [prompt], 4, "int4", residual=0)
    assert stacked == [True, False, True, True]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert c_stack.layers[0].chunks == [1] and c_stack.layers[0].res == [2]


LONG = [("llama", [1100], {}), ("llama", [700, 1030], {}),
        ("gemma3_text", [900], {"sliding_window": 300})]  # a window that starts inside a KIVI chunk


@pytest.mark.parametrize("model_type,lengths,extra", LONG)
@pytest.mark.parametrize("cache", ["contiguous", "fp8", "int8", "int4", "int2"])
def test_long_rows_cut_into_pieces_equal_the_layers(kernel, stacked, model_type, lengths, extra, cache):
    """Rows of 700-1,100 tokens on 2 threads: 1-2 rows x 2 KV heads are 2-4 jobs, which the stack cuts along their
    tokens into pieces of >= 256 (common.h's cut_jobs) and merges (run_pieces); the layers attend each row whole."""
    m = model(model_type, layers=6 if model_type == "gemma3_text" else 2, **extra)
    g = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(0, 40, (n,), generator=g) for n in lengths]
    got, expected, _, _ = decode(m, prompts, 3, cache)
    assert sum(stacked) >= 2  # a KIVI flush may leave one step to the layers
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert got.abs().max() > 1


def test_a_padding_row_leaves_the_step_to_the_layers(kernel, stacked):
    """A row at -1 (a finished sequence in generate) must not be written: those steps run layer by layer."""
    m = model("llama", layers=2)
    for name in ("fp8", "int4"):
        c = make_cache(name, m.spec, 2, 16, residual=RESIDUAL)
        with torch.inference_mode():
            m(torch.tensor([[1, 2, 3], [4, 5, 6]]), None, c)
            m(torch.tensor([[7], [8]]), torch.tensor([[3], [3]]), c)
            m(torch.tensor([[7], [0]]), torch.tensor([[4], [-1]]), c)
        assert stacked == [True, False], name
        stacked.clear()


def test_e4m3_codes_read_as_torch_reads_them(kernel):
    """All 256 codes but NaN's two (0x7f, 0xff) through the kernel's conversion; lengths of 256 and 250 take the
    vector path (16 at a time where AVX-512 is) and the scalar tail."""
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float()  # torch's own e4m3fn -> fp32
    got = kernel.e4m3_read(codes)
    finite = torch.isfinite(expected)
    assert (~finite).nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(got[finite], expected[finite])
    # by hand: 0 1111 110 = 2^8 x 1.75 (the max), 0 0000 001 = 2^-6 x 1/8 (the least subnormal), 0 0111 000 = 1
    assert got[0x7E] == 448 and got[0x01] == 2.0 ** -9 and got[0x38] == 1
    assert got[0x80] == 0 and bool(torch.signbit(got[0x80]))  # -0
    tail = codes.flip(0)[:250].contiguous()
    e = tail.view(torch.float8_e4m3fn).float()
    assert torch.equal(kernel.e4m3_read(tail)[torch.isfinite(e)], e[torch.isfinite(e)])


def test_e4m3_writes_round_as_the_fp8_cache_does(kernel):
    """The kernel's write (clamp to +-448, then c10's round to nearest even) against caches/fp8.py's torch cast, on
    every e4m3 value, the midpoints between neighbours (ties), just either side of them, values past the range and
    random ones."""
    values = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()  # (253,) sorted: -448 .. 448, one zero
    mid = (values[1:] + values[:-1]) / 2  # exact in fp32: ties
    x = torch.cat([values, mid, mid.nextafter(torch.tensor(float("inf"))), mid.nextafter(torch.tensor(-float("inf"))),
                   torch.tensor([449.0, 464.0, 480.0, 1e6, -1e6, float("inf"), -float("inf"), 2.0 ** -10, -2.0 ** -11]),
                   torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 50])
    expected = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)  # Fp8Layer.update's rounding
    got = kernel.e4m3_write(x.contiguous())
    assert torch.equal(got, expected)
    assert kernel.e4m3_write(torch.tensor([449.0, -1e6])).tolist() == [0x7E, 0xFE]  # +-448 (0x7e by hand), not NaN
