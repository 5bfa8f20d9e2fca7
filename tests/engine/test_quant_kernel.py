"""Decode attention read straight from the packed bytes equals attention over the dequantized cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from native_kernels import built  # noqa: E402
from tiny_checkpoints import VOCAB  # noqa: E402

from kvwall.engine.caches import make_cache, quantized as quantized_module  # noqa: E402
from kvwall.engine.caches.quant_kernel import quantized_decode  # noqa: E402
from kvwall.engine.caches.quantized import QuantizedLayer  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.layers.attention import attend_reference, visible  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402
from kvwall.spec.model import Attention  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    return built(quantized_decode, "quantized_decode")


CASES = [(fmt, rep, window, 64) for fmt in ["int8", "int4", "int2", "int4:g16:sym", "int8:g32", "int4:g8"]
         for rep, window in [(3, None), (1, 50), (4, 7)]]
CASES += [(fmt, 2, None, 24) for fmt in ["int8", "int4:g8", "int2:g8:sym"]]  # 24: not a whole SIMD vector


@pytest.mark.parametrize("fmt,rep,window,head_dim", CASES)
def test_kernel_equals_attention_over_dequantized_cache(kernel, fmt, rep, window, head_dim):
    """Rows of 300 / 130 / 20 tokens (a chunk cut by the window, a row with nothing quantized), GQA groups
    of 1-4, symmetric and asymmetric formats, value groups smaller than the head (g8 on 64 and 24)."""
    B, H, S = 3, 2, 300
    g = torch.Generator().manual_seed(0)
    layer = QuantizedLayer(Attention(H * rep, H, head_dim, head_dim), B, S + 8, get_format(fmt), 32,
                           torch.float32, "cpu")
    lengths = [300, 130, 20]
    for b, n in enumerate(lengths):
        layer.append(b, torch.randn(H, n, head_dim, generator=g), torch.randn(H, n, head_dim, generator=g))
    assert layer.chunks[0] > 0 and layer.chunks[2] == 0  # both paths exercised: quantized tokens and none
    q = torch.randn(B, H * rep, 1, head_dim, generator=g)
    pos = torch.tensor([[n - 1] for n in lengths])
    got = layer.attend_decode(q, pos, head_dim ** -0.5, window, kernel)
    k_all, v_all, k_pos = layer.read(torch.float32)
    expected = attend_reference(q, k_all, v_all, visible(pos, k_pos, window), head_dim ** -0.5, None)
    assert got.shape == expected.shape == (B, H * rep, 1, head_dim)
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "int4:g16:sym"])
@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_rows_cut_into_pieces_equal_attention_over_dequantized_cache(kernel, fmt, window, threads):
    """Rows of 2,100 and 900 tokens: the kernel cuts each (row, KV head) into pieces of >= 256 tokens at chunk
    boundaries (common.h's cut_jobs; a 700-token window starts inside a chunk) and merges their softmax sums."""
    B, H, rep, D = 2, 2, 3, 64
    g = torch.Generator().manual_seed(1)
    layer = QuantizedLayer(Attention(H * rep, H, D, D), B, 2200, get_format(fmt), 32, torch.float32, "cpu")
    lengths = [2100, 900]
    for b, n in enumerate(lengths):
        layer.append(b, torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g))
    q = 3 * torch.randn(B, H * rep, 1, D, generator=g)  # peaked softmax: the merge's rescaling matters
    pos = torch.tensor([[n - 1] for n in lengths])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = layer.attend_decode(q, pos, D ** -0.5, window, kernel)
    finally:
        torch.set_num_threads(before)
    k_all, v_all, k_pos = layer.read(torch.float32)
    expected = attend_reference(q, k_all, v_all, visible(pos, k_pos, window), D ** -0.5, None)
    assert (got - expected).abs().max().item() < 1e-5


def test_a_padding_row_gets_a_finite_output(kernel):
    layer = QuantizedLayer(Attention(4, 2, 16, 16), 2, 200, get_format("int8:g32"), 8, torch.float32, "cpu")
    layer.append(0, torch.randn(2, 100, 16), torch.randn(2, 100, 16))
    y = layer.attend_decode(torch.randn(2, 4, 1, 16), torch.tensor([[99], [-1]]), 0.25, None, kernel)
    assert torch.isfinite(y).all()


@pytest.mark.slow
def test_decode_with_and_without_the_kernel_agree(kernel, checkpoint, monkeypatch):
    """The same model and prompts: logits through the kernel equal the dequantizing path's, tokens too."""
    path, _ = checkpoint("llama")
    model = load_model(path)
    x = torch.randint(0, VOCAB, (2, 60), generator=torch.Generator().manual_seed(4))

    def run():
        cache = make_cache("int4:g8", model.spec, 2, 64, residual=8)
        with torch.no_grad():
            out = [model(x[:, :4], None, cache)]
            out += [model(x[:, t:t + 1], torch.full((2, 1), t), cache) for t in range(4, 60)]
        return torch.cat(out, 1), generate(model, [[1, 2, 3], list(range(10, 40))], max_new_tokens=16,
                                            cache="int4:g8", residual=8).tokens

    with_kernel, tokens = run()
    monkeypatch.setattr(quantized_module, "quantized_decode", lambda: None)
    without, tokens_without = run()
    assert (with_kernel - without).abs().max().item() < 1e-4
    assert tokens == tokens_without
