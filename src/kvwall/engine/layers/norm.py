"""Normalisation layers: RMSNorm (Llama: x * w; Gemma: x * (1 + w)) and LayerNorm (GPT-2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.errors import KvwallError


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32.

    offset=1 is Gemma's (1 + w) form, which also multiplies by the weight before casting
    back; offset=0 (Llama, Qwen) casts back first, then multiplies (as transformers does).
    In fp32 both are torch's fused rms_norm (one op instead of eight); 16-bit inputs take the reference,
    whose casts round differently.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.eager = False  # True: the reference ops only (Transformer.set_eager)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not self.eager:  # one fused op, equal to the reference in fp32
            w = self.weight + self.offset if self.offset else self.weight
            return F.rms_norm(x, self.weight.shape, w, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., dim)
        if self.offset:
            return (y * (self.offset + self.weight.float())).type_as(x)
        return self.weight * y.type_as(x)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == "rms":
        return RMSNorm(dim, eps)
    if kind == "rms1p":
        return RMSNorm(dim, eps, offset=1.0)
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    raise KvwallError(f"norm {kind!r} is not one the engine runs (rms, rms1p, layer)")
