"""fp8 cache: the contiguous cache with K and V stored as real 8-bit floats (e4m3, one byte each).

Written values are clamped to e4m3's finite range (+-448; e4m3fn has no infinity, so an overflow would
become NaN) and rounded to 3 mantissa bits; attention reads them back in the compute dtype. No scale is
kept (the predictor's fp8 format counts a per-tensor scale as a few bytes: not counted), so this is what
a plain cast costs in accuracy.

nbytes() = predict.memory(spec.with_window(None), context=max_len, kv=fp8).cache_bytes: one byte per element.
"""

from __future__ import annotations

import torch

from kvwall.engine.caches.base import KVView
from kvwall.engine.caches.contiguous import ContiguousCache, ContiguousLayer
from kvwall.spec.model import Attention

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


class Fp8Layer(ContiguousLayer):
    def __init__(self, attn: Attention, batch: int, max_len: int, dtype, device):
        super().__init__(attn, batch, max_len, torch.float8_e4m3fn, device)

    def update(self, k, v, pos, length: int, at: int | None = None):
        to8 = lambda x: x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # noqa: E731
        return super().update(to8(k), to8(v), pos, length, at)  # (B, Hkv, S, D) in fp8: attend reads them upcast

    def view(self) -> KVView:
        """The fused decode step reads these bytes in place and writes the new token rounded as update() does
        (kernels/pool_rows.h); the layer-by-layer path upcasts the whole cache to fp32 for SDPA every step."""
        return KVView("fp8", self.k, self.v)


class Fp8Cache(ContiguousCache):
    name = "fp8"

    @staticmethod
    def _layer(a: Attention, batch: int, max_len: int, dtype, device):
        return Fp8Layer(a, batch, max_len, dtype, device)
