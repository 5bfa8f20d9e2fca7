"""The packed matmul's GEMM path (kernels/packed.h run_gemm: from GEMM_MIN_ROWS rows of x, the weight dequantized
to float32 a tile at a time and multiplied by torch's GEMM) against the reference path (layers/packed.py:
dequantize() + F.linear): the dequantized values bit for bit, the products within float tolerance for int4 / int8,
with and without zero points, groups of 32 / 64 / 128 with short last groups, odd N, below and above the
threshold and across tiles; and a tiny packed model's prefill logits against its reference path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_kernels import built  # noqa: E402
from tiny_checkpoints import ids  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.layers import packed  # noqa: E402
from kvwall.engine.layers.packed import PackedLinear, dequantize, gemm_min_rows, packed_kernel  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.engine.native import build  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402

# int4 / int8, asymmetric (a float16 zero per group) and symmetric, groups of 32, 64 and 128
FORMATS = ["int4:g32", "int4:g64:sym", "int4:g128", "int8:g32:sym", "int8:g64", "int8:g128:sym"]
ROWS_KERNEL, GEMM_ALWAYS = 0, 1  # packed_linear's gemm_rows: never the GEMM path; from one row on


def module():
    built(packed_kernel, "packed_linear")
    return build("packed_linear", "")[0]


def packed_linear(n: int, k: int, name: str, seed: int = 0, bias: bool = False) -> PackedLinear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    lin.weight.data = torch.randn(n, k) * 0.05
    if bias:
        lin.bias.data = torch.randn(n) * 0.1
    return PackedLinear.from_linear(lin, get_format(name))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("n,k", [(37, 200), (5, 70), (64, 256)])
def test_gemm_path_dequantizes_exactly_as_the_reference(name, n, k):
    """The float32 matrix the GEMM multiplies is dequantize()'s, bit for bit (d q is exact in float32: an fp16 d has
    11 significant bits and q < 2^8). K = 200 leaves a last group of 8 (g32), 8 (g64) or 72 (g128); 70 one of 6."""
    p = packed_linear(n, k, name)
    got = module().packed_dequantize(p.q, p.scale, p.zero, p.bits, k, p.group)  # (N, K)
    assert torch.equal(got, dequantize(p.q, p.scale, p.zero, p.bits, k, p.group))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("n,k", [(37, 200), (53, 70)])
def test_gemm_path_equals_the_reference_matmul(name, n, k):
    """Both paths forced (gemm_rows 1: the GEMM path; 0: the row kernel) and the default at either side of
    GEMM_MIN_ROWS, against dequantize() + F.linear; odd N, K tails; a bias added after."""
    mod = module()
    threshold = gemm_min_rows()
    p = packed_linear(n, k, name, bias=True)
    w = p.dequantized()  # (N, K) the reference's matrix
    for m in (2, threshold - 1, threshold, 3 * threshold + 5):
        x = torch.randn(m, k)  # (M, K)
        want = x @ w.T  # (M, N)
        for gemm_rows in (GEMM_ALWAYS, ROWS_KERNEL, -1):
            got = mod.packed_linear(x, p.q, p.scale, p.zero, p.bits, p.group, gemm_rows)  # (M, N)
            assert got.shape == (m, n)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(p(x[None]), p.reference(x[None]), rtol=1e-5, atol=1e-5)  # (1, M, N)


@pytest.mark.parametrize("name", ["int4:g32", "int8:g128:sym"])
def test_gemm_path_across_tiles(name):
    """N K over packed.h's GEMM_TILE_FLOATS (2^20): 300 rows of 4096 go as a tile of 256 rows and one of 44, each
    GEMM writing its own columns of y in place."""
    mod = module()
    p = packed_linear(300, 4096, name)
    x = torch.randn(40, 4096)  # (M, K)
    got = mod.packed_linear(x, p.q, p.scale, p.zero, p.bits, p.group, GEMM_ALWAYS)  # (M, N)
    torch.testing.assert_close(got, x @ p.dequantized().T, rtol=1e-4, atol=1e-4)


def test_gemm_rows_switch_is_read_at_each_call(monkeypatch):
    """packed.GEMM_ROWS = 0 (benchmarks/bench_prefill.py's "before") keeps the row kernel: PackedLinear's forward
    passes it through, and both give the reference's numbers."""
    built(packed_kernel, "packed_linear")
    p = packed_linear(37, 200, "int4:g32")
    x = torch.randn(2, 50, 200)  # (B, T, K): 100 rows
    with torch.no_grad():
        after = p(x)
        monkeypatch.setattr(packed, "GEMM_ROWS", 0)
        before = p(x)
        want = p.reference(x)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(before, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["q4_1", "int8:g64:sym"])
def test_packed_model_prefill_logits_equal_the_reference_path(checkpoint, name):
    """A tiny packed llama's prefill of 2 x 48 tokens (96 rows per projection: the GEMM path) over a contiguous
    cache, last positions only as generate() asks, and a full forward: the same logits as its reference path
    (set_eager: every PackedLinear dequantizes + F.linear), and then the same decode step."""
    built(packed_kernel, "packed_linear")
    path, _ = checkpoint("llama")
    model = load_model(path, weights=name)
    tokens = ids(2, 48)
    assert tokens.numel() >= gemm_min_rows()
    runs = {}
    with torch.no_grad():
        for eager in (False, True):
            model.set_eager(eager)
            cache = make_cache("contiguous", model.spec, 2, 64)
            last = model(tokens, None, cache, last_only=True)  # (B, 1, V)
            step = model(last.argmax(-1), torch.full((2, 1), 48), cache)  # (B, 1, V)
            runs[eager] = (model(tokens), last, step)  # full forward (B, T, V) too
    for fast, ref in zip(runs[False], runs[True]):
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runs[False][1], runs[False][0][:, -1:], rtol=1e-5, atol=1e-5)
