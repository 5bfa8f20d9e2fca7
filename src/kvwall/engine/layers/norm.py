"""Normalisation layers: RMSNorm (Llama: x * w; Gemma: x * (1 + w)) and LayerNorm (GPT-2)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.native import compiled
from kvwall.errors import KvwallError


@functools.lru_cache(maxsize=1)
def rms_kernel():
    """The compiled ``add_rms_norm`` of kernels/fused_ops.cpp, or None if it cannot be built.

    Why: torch's fused rms_norm on one 576-float row (SmolLM2's decode step) takes 17 us warm and 47 us inside a
    step (its mean and division are separate parallel ops), 61 times a step: 2.9 ms of a 35 ms fp32 step at batch 1
    (benchmarks/profile_decode.py, 2026-12-03). The kernel normalises a row in one pass on the calling thread,
    and adds the residual branch first when asked (the add before every layer's second norm)."""
    return compiled("fused_ops", "add_rms_norm", "torch's rms_norm")


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32.

    offset=1 is Gemma's (1 + w) form, which also multiplies by the weight before casting
    back; offset=0 (Llama, Qwen) casts back first, then multiplies (as transformers does).
    In fp32 both are one op instead of eight: the C++ kernel (rms_kernel) on the CPU, else torch's fused rms_norm;
    16-bit inputs take the reference, whose casts round differently.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.eager = False  # True: the reference ops only (Transformer.set_eager)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel(x)
        if kernel is not None:
            return kernel(x, None, self.weight, self.eps, self.offset)[1]
        if x.dtype == torch.float32 and not self.eager:  # one fused op, equal to the reference in fp32
            w = self.weight + self.offset if self.offset else self.weight
            return F.rms_norm(x, self.weight.shape, w, self.eps)
        return self.reference(x)

    def add(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, self(x + h)): a residual add and this norm after it, one C++ call in the fast path."""
        kernel = self.kernel(x)
        if kernel is not None and h.dtype == torch.float32:
            s, y = kernel(x, h, self.weight, self.eps, self.offset)
            return s, y
        s = x + h
        return s, self(s)

    def kernel(self, x: torch.Tensor):
        """add_rms_norm for the fast path on fp32 CPU tensors outside autograd, else None (torch's ops)."""
        if self.eager or x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.dtype != torch.float32:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return None  # the kernel has no backward
        return rms_kernel()

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim)
        if self.offset:
            return (y * (self.offset + self.weight.float())).type_as(x)
        return self.weight * y.type_as(x)


class GatedRMSNorm(nn.Module):
    """An RMSNorm with an output gate z, over groups of `group` channels (the weight over all `dim`), all in fp32:

    before_gate (Gated DeltaNet, Kimi Delta Attention, Falcon-H1's Mamba-2):  rmsnorm(y) · w · act(z), cast at the end
    else (Mamba-2):                                                           rmsnorm(y · silu(z)) · w
    act: the gate, F.silu or torch.sigmoid (Kimi Delta Attention). cast_first (Qwen3-Next / Qwen3.5, before_gate):
    rmsnorm(y) is cast to y's dtype before w multiplies it, as transformers' Qwen3NextRMSNormGated does (the same
    numbers in fp32; one rounding more in bf16). Gated DeltaNet and KDA normalise per head: y (.., heads, d),
    group = dim = d."""

    def __init__(self, dim: int, group: int, eps: float, before_gate: bool = False, act=F.silu,
                 cast_first: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps, self.before_gate, self.act, self.cast_first = group, eps, before_gate, act, cast_first

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        g = y.float() if self.before_gate else y.float() * F.silu(z.float())  # (.., dim)
        g = g.unflatten(-1, (-1, self.group))  # (.., dim / group, group)
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)  # (.., dim)
        if not self.before_gate:
            return self.weight * g.to(y.dtype)  # (.., dim)
        n = self.weight * g.to(y.dtype) if self.cast_first else self.weight.float() * g  # (.., dim)
        return (n * self.act(z.float())).to(y.dtype)  # (.., dim)


def add_norm(norm: nn.Module, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, norm(x + h)): fused where the norm has it (RMSNorm.add)."""
    if isinstance(norm, RMSNorm):
        return norm.add(x, h)
    s = x + h
    return s, norm(s)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == "rms":
        return RMSNorm(dim, eps)
    if kind == "rms1p":
        return RMSNorm(dim, eps, offset=1.0)
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    raise KvwallError(f"norm {kind!r} is not one the engine runs (rms, rms1p, layer)")
