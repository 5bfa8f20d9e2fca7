"""Rotary position embedding (RoFormer), in the half-split layout transformers uses.

For a head vector x = [x1, x2] (halves of the rotated part, width r = partial * head_dim):
    rope(x, p) = [x1 cos(p w) - x2 sin(p w),  x2 cos(p w) + x1 sin(p w)],  w_i = theta^(-2i / r)
Scaling (Rope.kind): "linear" divides every w by factor; "llama3" divides the low
frequencies (wavelength > original_max / low_freq_factor) by factor, keeps the high ones
(wavelength < original_max / high_freq_factor) and interpolates linearly in between.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvwall.errors import KvwallError
from kvwall.spec.model import Rope

ROPE_KINDS = ("default", "linear", "llama3")


def inv_frequencies(rope: Rope, head_dim: int) -> torch.Tensor:
    """w_i for i < r/2, fp32, after the rope's scaling."""
    if rope.kind not in ROPE_KINDS:
        raise KvwallError(f"rope scaling {rope.kind!r} is not one the engine runs ({', '.join(ROPE_KINDS)})")
    r = int(head_dim * rope.partial)
    assert r % 2 == 0 and 0 < r <= head_dim, (r, head_dim)
    w = 1.0 / (rope.theta ** (torch.arange(0, r, 2, dtype=torch.int64, device="cpu").float() / r))  # (r/2,)
    if rope.kind == "linear":
        return w / rope.factor
    if rope.kind == "llama3":
        return _llama3(w, rope)
    return w


def _llama3(w: torch.Tensor, rope: Rope) -> torch.Tensor:
    old = rope.original_max_position
    assert old, "llama3 rope scaling needs original_max_position_embeddings"
    wavelen = 2 * math.pi / w
    ramp = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    ramp = ramp.clamp(0.0, 1.0)  # 0: low frequency (scaled), 1: high frequency (kept)
    return (1 - ramp) * w / rope.factor + ramp * w


class Rotary(nn.Module):
    """cos/sin tables for given positions; apply() rotates q or k."""

    def __init__(self, rope: Rope, head_dim: int):
        super().__init__()
        self.rope = rope
        self.rot_dim = int(head_dim * rope.partial)
        self.register_buffer("inv_freq", inv_frequencies(rope, head_dim), persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = pos.clamp(min=0).float()[..., None] * self.inv_freq  # (B, T, r/2)
        emb = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # (B, T, 1, r)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos/sin: (B, T, 1, r) with r <= D (the rest of x passes through)."""
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]  # (B, T, H, r), (B, T, H, D - r)
    x1, x2 = xr.chunk(2, dim=-1)  # (B, T, H, r/2) each
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, T, H, r)
    out = xr * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)
