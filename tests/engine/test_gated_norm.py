"""The one gated RMSNorm (engine/layers/norm.py GatedRMSNorm) in each of its four uses, against the transformers 5.25
module it stands for: Qwen3-Next / Qwen3.5's (Gated DeltaNet), Kimi Linear's (sigmoid gate), Falcon-H1's (Mamba-2
normalised before the gate, in groups) and Mamba-2's (gate first), in fp32 and bf16 (where the point at which each
casts back to the input's dtype shows), to the last bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvwall.engine.layers.norm import GatedRMSNorm  # noqa: E402


def theirs(name: str, dim: int, group: int):
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated
    from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    return {
        "qwen3_next": lambda: Qwen3NextRMSNormGated(dim, eps=1e-6),
        "kimi_linear": lambda: KimiLinearRMSNormGated(dim, eps=1e-6),
        "falcon_h1": lambda: FalconH1RMSNormGated(dim, eps=1e-6, n_groups=dim // group, norm_before_gate=True),
        "mamba2": lambda: Mamba2RMSNormGated(dim, group, eps=1e-6),
    }[name]()


def ours(name: str, dim: int, group: int) -> GatedRMSNorm:
    return {
        "qwen3_next": lambda: GatedRMSNorm(dim, dim, 1e-6, before_gate=True, cast_first=True),
        "kimi_linear": lambda: GatedRMSNorm(dim, dim, 1e-6, before_gate=True, act=torch.sigmoid),
        "falcon_h1": lambda: GatedRMSNorm(dim, group, 1e-6, before_gate=True),
        "mamba2": lambda: GatedRMSNorm(dim, group, 1e-6),
    }[name]()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3_next", "kimi_linear", "falcon_h1", "mamba2"])
def test_equals_the_transformers_module_bit_for_bit(name, dtype):
    """Per-head norms (Qwen3-Next, Kimi: y (B, T, heads, d), one group of d) and grouped ones (Falcon-H1, Mamba-2:
    y (B, T, 32), 4 groups of 8); weights random, not ones."""
    per_head = name in ("qwen3_next", "kimi_linear")
    dim, group = (16, 16) if per_head else (32, 8)
    shape = (2, 5, 3, dim) if per_head else (2, 5, dim)
    g = torch.Generator().manual_seed(0)
    ref, me = theirs(name, dim, group).to(dtype), ours(name, dim, group).to(dtype)
    with torch.no_grad():
        w = (1 + 0.5 * torch.randn(dim, generator=g)).to(dtype)
        ref.weight.copy_(w)
        me.weight.copy_(w)
        y, z = (3 * torch.randn(*shape, generator=g)).to(dtype), torch.randn(*shape, generator=g).to(dtype)
        expected, got = ref(y, z), me(y, z)
    assert got.dtype == expected.dtype == dtype and torch.equal(got, expected)


def test_the_cast_point_matters_in_bf16():
    """Qwen3-Next rounds rmsnorm(y) to bf16 before the weight multiplies it, Kimi / Falcon-H1 do not: in bf16 the two
    orders differ somewhere (so cast_first is a real difference), in fp32 they agree."""
    g = torch.Generator().manual_seed(1)
    y, z = 3 * torch.randn(4, 64, 16, generator=g), torch.randn(4, 64, 16, generator=g)
    first, late = GatedRMSNorm(16, 16, 1e-6, True, cast_first=True), GatedRMSNorm(16, 16, 1e-6, True)
    with torch.no_grad():
        for m in (first, late):
            m.weight.copy_(1 + 0.5 * torch.randn(16, generator=torch.Generator().manual_seed(2)))
        assert torch.equal(first(y, z), late(y, z))
        assert not torch.equal(
            first.bfloat16()(y.bfloat16(), z.bfloat16()), late.bfloat16()(y.bfloat16(), z.bfloat16())
        )
