"""MXFP4 weights (OCP Microscaling FP4), as gpt-oss checkpoints store their experts, dequantized on load.

A matrix W (..., R, C) is stored as two tensors:
    W_blocks (..., R, C/32, 16) uint8   32 e2m1 values per block of a row, two per byte, the low nibble first
    W_scales (..., R, C/32)     uint8   one shared exponent per block, e8m0: the block's values times 2^(s - 127)
An e2m1 nibble is sign (bit 3), a 2-bit exponent (bias 1) and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives (OCP Microscaling Formats v1.0, section 5.3.3; the same table is transformers 5.25's
integrations/mxfp4.py FP4_VALUES). gpt-oss keeps each expert's rows as (out, in) there; the dequantized tensor is
transposed to (..., in, out), the layout of its unquantized gate_up_proj / down_proj (transformers'
convert_moe_packed_tensors ends with the same transpose). kvwall.spec.formats counts the bytes: 4.25 bits a value.
"""

from __future__ import annotations

import torch

from kvwall.errors import KvwallError

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one exponent
BIAS = 127  # e8m0's exponent bias


def stored_shape(blocks: tuple[int, ...], scales: tuple[int, ...], where: str) -> tuple[int, ...]:
    """The dequantized, transposed shape (..., C, R) of blocks (..., R, C/32, 16) and scales (..., R, C/32); a
    one-line error when the two are not MXFP4's pair."""
    if len(blocks) < 3 or blocks[-1] != BLOCK // 2 or tuple(blocks[:-1]) != tuple(scales):
        raise KvwallError(f"{where}: blocks {tuple(blocks)} and scales {tuple(scales)} are not MXFP4 (blocks "
                          "(..., rows, n, 16) uint8 and scales (..., rows, n) uint8); re-save the checkpoint")
    *lead, rows, groups, _ = blocks
    return (*lead, groups * BLOCK, rows)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks (..., R, G, 16) uint8 and scales (..., R, G) uint8 -> W (..., G*32, R) float32, transposed."""
    lut = torch.tensor(E2M1)  # (16,)
    codes = blocks.to(torch.uint8)
    lo, hi = lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]  # (..., R, G, 16) each
    values = torch.stack([lo, hi], -1).flatten(-2)  # (..., R, G, 32): the low nibble first
    scale = torch.exp2(scales.to(torch.uint8).float() - BIAS)  # (..., R, G): powers of two, exact in fp32
    w = (values * scale[..., None]).flatten(-2)  # (..., R, C)
    return w.transpose(-1, -2).contiguous()  # (..., C, R)
