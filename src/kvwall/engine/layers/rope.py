"""Rotary position embedding (RoFormer), in the half-split layout transformers uses.

For a head vector x = [x1, x2] (halves of the rotated part, width r = partial * head_dim):
    rope(x, p) = [x1 cos(p w) - x2 sin(p w),  x2 cos(p w) + x1 sin(p w)],  w_i = theta^(-2i / r)
DeepSeek's interleaved layout rotates pairs instead: x1 = x[0::2], x2 = x[1::2] (Rope.interleaved);
the output keeps the [x1', x2'] order, the same permutation for q and k, so q.k is unchanged.
Scaling (Rope.kind): "linear" divides every w by factor; "llama3" divides the low
frequencies (wavelength > original_max / low_freq_factor) by factor, keeps the high ones
(wavelength < original_max / high_freq_factor) and interpolates linearly in between;
"yarn" ramps between w / factor and w over the dimensions that turn between beta_slow and
beta_fast times in original_max tokens, and scales cos/sin by an attention factor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from kvwall.errors import KvwallError
from kvwall.spec.model import Rope

ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def inv_frequencies(rope: Rope, head_dim: int) -> torch.Tensor:
    """w_i for i < r/2, fp32, after the rope's scaling."""
    if rope.kind not in ROPE_KINDS:
        raise KvwallError(f"rope scaling {rope.kind!r} is not one the engine runs ({', '.join(ROPE_KINDS)})")
    r = int(head_dim * rope.partial)
    assert r % 2 == 0 and 0 < r <= head_dim, (r, head_dim)
    w = 1.0 / (rope.theta ** (torch.arange(0, r, 2, dtype=torch.int64, device="cpu").float() / r))  # (r/2,)
    if not torch.isfinite(w).all() or not (w > 0).all():  # e.g. a negative theta: NaN rotations, garbage tokens
        raise KvwallError(f"rope_theta {rope.theta} gives non-finite rotary frequencies; rope_theta in config.json "
                          "must be a positive number (usually 10000 or more)")
    if rope.kind == "linear":
        return w / rope.factor
    if rope.kind == "llama3":
        return _llama3(w, rope)
    if rope.kind == "yarn":
        return _yarn(w, rope, r)
    return w


def _llama3(w: torch.Tensor, rope: Rope) -> torch.Tensor:
    old = rope.original_max_position
    assert old, "llama3 rope scaling needs original_max_position_embeddings"
    wavelen = 2 * math.pi / w
    ramp = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    ramp = ramp.clamp(0.0, 1.0)  # 0: low frequency (scaled), 1: high frequency (kept)
    return (1 - ramp) * w / rope.factor + ramp * w


def _yarn(w: torch.Tensor, rope: Rope, r: int) -> torch.Tensor:
    old = rope.original_max_position
    assert old and rope.factor, "yarn rope scaling needs original_max_position_embeddings and factor"
    dim_of = lambda turns: r * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))  # noqa: E731
    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)  # dims turning beta_fast / beta_slow times
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    high = high + 0.001 if low == high else high
    i = torch.arange(r // 2, dtype=torch.float32, device="cpu")  # (r/2,)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)  # 0: frequency kept, 1: divided by factor
    return ramp * w / rope.factor + (1 - ramp) * w


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def attention_factor(rope: Rope) -> float:
    """YaRN multiplies cos and sin by this (DeepSeek: mscale(factor, mscale) / mscale(factor, mscale_all_dim))."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _mscale(rope.factor, rope.mscale) / _mscale(rope.factor, rope.mscale_all_dim)
    return _mscale(rope.factor)


class RopeTables(NamedTuple):
    """One forward pass's rotary tables, (B, T, 1, r) each: cos, sin, and sin with its first half negated
    (what rotate() multiplies the half-swapped x by, so that a layer does not negate anything)."""

    cos: torch.Tensor
    sin: torch.Tensor
    sin_swapped: torch.Tensor


class Rotary(nn.Module):
    """cos/sin tables for given positions (once per forward pass, shared by every layer that rotates alike)."""

    def __init__(self, rope: Rope, head_dim: int):
        super().__init__()
        self.rope = rope
        self.rot_dim = int(head_dim * rope.partial)
        self.scale = attention_factor(rope)
        self.register_buffer("inv_freq", inv_frequencies(rope, head_dim), persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        angles = pos.clamp(min=0).float()[..., None] * self.inv_freq  # (B, T, r/2)
        emb = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # (B, T, 1, r)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        cos, sin = cos.to(dtype), sin.to(dtype)
        half = sin.shape[-1] // 2
        return RopeTables(cos, sin, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos/sin: (B, T, 1, r) with r <= D (the rest of x passes through). The reference."""
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]  # (B, T, H, r), (B, T, H, D - r)
    x1, x2 = xr.chunk(2, dim=-1)  # (B, T, H, r/2) each
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, T, H, r)
    out = xr * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


def rotate(x: torch.Tensor, t: RopeTables) -> torch.Tensor:
    """apply_rope(x, t.cos, t.sin) in four ops instead of about ten, equal to it bit for bit:
    [-x2, x1] * sin is the half-swapped [x2, x1] times [-sin1, sin2] (a sign flip is exact)."""
    *lead, D = x.shape
    if t.cos.shape[-1] != D:  # partial rotary: the reference slices it
        return apply_rope(x, t.cos, t.sin)
    swapped = x.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)  # (B, T, H, D): [x2, x1]
    return x * t.cos + swapped * t.sin_swapped


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's pairs: x (B, T, H, r) with x1 = x[0::2], x2 = x[1::2]; cos/sin (B, T, 1, r) as Rotary makes them."""
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]  # (B, T, 1, r/2): one angle per pair
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, T, H, r/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, T, H, r)
