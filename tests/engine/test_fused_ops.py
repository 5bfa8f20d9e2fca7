"""The fused small ops (kernels/fused_ops.cpp: residual add + RMSNorm, silu(gate) * up) against their formulas in
float64, and the fast path's blocks (which use them) against the eager reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_kernels import built  # noqa: E402

from kvwall.engine.layers.mlp import silu_mul_kernel  # noqa: E402
from kvwall.engine.layers.norm import RMSNorm, add_norm, rms_kernel  # noqa: E402
from kvwall.engine.model import Transformer  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    return built(rms_kernel, "fused_ops")


def by_hand(x, w, eps, offset):
    """x / sqrt(mean(x^2) + eps) * (offset + w) in float64."""
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (offset + w.double())


@pytest.mark.parametrize("shape", [(1, 1, 576), (16, 1, 576), (3, 7, 37), (2, 5, 8), (4096, 64), (0, 3, 16)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_kernel_equals_the_formula(kernel, shape, offset):
    """D = 37 is not a whole SIMD vector, 4096 rows run in parallel, 0 rows return empty tensors."""
    g = torch.Generator().manual_seed(sum(shape))
    x, h = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    s, y = kernel(x, h, w, 1e-6, offset)
    assert torch.equal(s, x + h)  # one fp32 add per element: exact
    torch.testing.assert_close(y.double(), by_hand(x + h, w, 1e-6, offset), rtol=1e-5, atol=1e-5)
    s0, y0 = kernel(x, None, w, 1e-6, offset)
    assert s0.data_ptr() == x.data_ptr() or x.numel() == 0  # no add asked: x itself comes back
    torch.testing.assert_close(y0.double(), by_hand(x, w, 1e-6, offset), rtol=1e-5, atol=1e-5)


def test_kernel_takes_strided_input_and_checks_shapes(kernel):
    x = torch.randn(4, 6, 32).transpose(0, 1)  # (6, 4, 32), not contiguous
    w = torch.rand(32)
    torch.testing.assert_close(kernel(x, None, w, 1e-5, 0.0)[1].double(), by_hand(x, w, 1e-5, 0.0))
    with pytest.raises(RuntimeError, match="weight must be"):
        kernel(x, None, torch.rand(31), 1e-5, 0.0)
    with pytest.raises(RuntimeError, match="shaped like x"):
        kernel(x, torch.randn(6, 4, 31), w, 1e-5, 0.0)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel(x.double(), None, w, 1e-5, 0.0)


def test_norm_uses_the_kernel_only_outside_autograd(kernel):
    norm = RMSNorm(16, 1e-5, offset=1.0)
    x, h = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        s, y = add_norm(norm, x, h)
        assert norm.kernel(x) is kernel
    assert norm.kernel(x) is None and y.grad_fn is None
    torch.testing.assert_close(y.double(), by_hand(x + h, norm.weight.detach(), 1e-5, 1.0))
    s, y = add_norm(norm, x, h)  # grad enabled and the weight is a parameter: torch's ops, which train
    y.sum().backward()
    assert norm.weight.grad is not None
    norm.eager = True
    with torch.no_grad():
        assert norm.kernel(x) is None


def tiny(model_type="llama", **extra):
    cfg = {"model_type": model_type, "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 40, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-6, **extra}
    return spec_from_config(cfg, name="tiny")


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_fast_blocks_equal_the_eager_reference(kernel, model_type):
    """Llama's x * w and Gemma's sandwich norms with x * (1 + w): logits of the fast path (the kernel) equal the
    eager path's (torch ops in the checkpoint's layout) to fp32 rounding."""
    extra = {"head_dim": 12, "query_pre_attn_scalar": 12, "sliding_window": 8} if model_type == "gemma3_text" else {}
    torch.manual_seed(0)
    model = Transformer(tiny(model_type, **extra))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    tokens = torch.randint(0, 40, (2, 11))
    with torch.no_grad():
        fast = model.set_eager(False)(tokens)
        eager = model.set_eager(True)(tokens)
    torch.testing.assert_close(fast, eager, rtol=1e-4, atol=1e-4)
    assert not torch.equal(fast, torch.zeros_like(fast))


@pytest.fixture(scope="module")
def silu_mul():
    return built(silu_mul_kernel, "fused_ops")


@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (16, 1, 2 * 1536), (3, 5, 2 * 37), (0, 2, 8)])
def test_silu_mul_equals_the_formula(silu_mul, shape):
    """silu(g) * u = g / (1 + e^-g) * u in float64, for [g, u] side by side; widths off the SIMD vector too."""
    gu = 4 * torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1]))
    g, u = gu.double().chunk(2, -1)
    torch.testing.assert_close(silu_mul(gu).double(), g / (1 + torch.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    strided = gu.transpose(0, 1)  # not contiguous
    torch.testing.assert_close(silu_mul(strided), silu_mul(strided.contiguous()))
    with pytest.raises(RuntimeError, match="same width"):
        silu_mul(torch.randn(2, 5))
