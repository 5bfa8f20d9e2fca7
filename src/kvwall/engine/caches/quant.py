"""Group-wise integer quantization with the byte layout of kvwall.spec.formats.

A vector of n elements is cut into groups of g elements along its last dimension; each
group stores `bits` per element, packed little-end-first into bytes (8 / bits values per
byte), plus an fp16 scale and (asymmetric formats) an fp16 zero point:

    asymmetric: x ~ zero + scale * q,  q in [0, 2^bits - 1],  scale = (max - min) / (2^bits - 1), zero = min
    symmetric:  x ~ scale * (q - 2^(bits-1)),                 scale = absmax / (2^(bits-1) - 1)

The round-trip error of one element is at most scale / 2 (plus fp16 rounding of scale and zero).
"""

from __future__ import annotations

import torch

from kvwall.errors import KvwallError
from kvwall.spec.formats import Format


def group_size(fmt: Format, n: int) -> int:
    """The group used for vectors of n elements: the format's group, or one group when n is smaller."""
    assert fmt.group is not None and not fmt.is_float(), fmt
    g = min(fmt.group, n)
    if n % g or (n * fmt.bits) % 8:
        raise KvwallError(f"{fmt.label}: a vector of {n} elements is not a whole number of {g}-element groups "
                          f"and bytes; pick a group size that divides {n}")
    return g


def quantize(x: torch.Tensor, fmt: Format, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (..., n) -> packed (..., n * bits / 8) uint8, scale (..., n / g) fp16, zero (..., n / g) fp16 or None."""
    *lead, n = x.shape
    xg = x.float().reshape(*lead, n // g, g)  # (..., n / g, g)
    levels = 2 ** fmt.bits - 1
    if fmt.zero_bytes:
        lo, hi = xg.amin(-1), xg.amax(-1)  # (..., G)
        scale = ((hi - lo) / levels).clamp(min=1e-8).half()
        zero = lo.half()
        q = ((xg - zero.float()[..., None]) / scale.float()[..., None]).round().clamp(0, levels)
    else:
        half = 2 ** (fmt.bits - 1)
        scale = (xg.abs().amax(-1) / (half - 1)).clamp(min=1e-8).half()
        zero = None
        q = (xg / scale.float()[..., None]).round().clamp(-half + 1, half - 1) + half
    return pack(q.to(torch.uint8).reshape(*lead, n), fmt.bits), scale, zero


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: Format,
               g: int) -> torch.Tensor:
    """Inverse of quantize, in fp32: (..., n * bits / 8) -> (..., n)."""
    q = unpack(packed, fmt.bits).float()  # (..., n)
    *lead, n = q.shape
    qg = q.reshape(*lead, n // g, g)  # (..., G, g)
    if zero is not None:
        x = zero.float()[..., None] + scale.float()[..., None] * qg
    else:
        x = scale.float()[..., None] * (qg - 2 ** (fmt.bits - 1))
    return x.reshape(*lead, n)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) uint8 values < 2^bits -> (..., n * bits / 8) uint8."""
    per = 8 // bits
    if per == 1:
        return q
    qs = q.reshape(*q.shape[:-1], q.shape[-1] // per, per).to(torch.int32)  # (..., n / per, per)
    shifts = torch.arange(per, device=q.device, dtype=torch.int32) * bits
    return (qs << shifts).sum(-1).to(torch.uint8)


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return p
    shifts = torch.arange(per, device=p.device, dtype=torch.int32) * bits
    q = (p.to(torch.int32)[..., None] >> shifts) & (2 ** bits - 1)  # (..., n / per, per)
    return q.reshape(*p.shape[:-1], p.shape[-1] * per).to(torch.uint8)
