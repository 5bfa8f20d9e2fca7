"""Sliding-window cache: local layers keep a ring buffer of `window` slots, global layers a contiguous buffer.

Position p lives in ring slot p % window. Memory stops growing at the window while
attention stays exact: a query at p only sees keys with p - j < window, and those are
exactly the last `window` positions. A multi-token step (prefill) longer than the
window must see keys the ring is about to overwrite, so it attends over
[old ring ; new tokens] and then keeps only the newest `window` tokens.

nbytes() = predict.memory(spec, batch, context=max_len).cache_bytes (windows respected).
"""

from __future__ import annotations

import torch

from kvwall.engine.caches.contiguous import ContiguousCache, ContiguousLayer
from kvwall.spec.model import Attention


class RingLayer:
    def __init__(self, attn: Attention, batch: int, window: int, dtype, device):
        self.window = window
        self.k = torch.zeros(batch, attn.n_kv_heads, window, attn.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, attn.n_kv_heads, window, attn.v_head_dim, dtype=dtype, device=device)
        self.pos = torch.full((batch, window), -1, dtype=torch.long, device=device)  # position in each slot

    def write(self, k, v, pos):
        end = pos.max(dim=1, keepdim=True).values + 1  # (B, 1)
        newest = (pos >= 0) & (pos >= end - self.window)  # (B, T): the tokens the ring keeps
        b, t = newest.nonzero(as_tuple=True)
        p = pos[b, t]
        slot = p % self.window  # distinct within a row: at most `window` consecutive positions
        self.k[b, :, slot] = k[b, :, t]  # (N, Hkv, D)
        self.v[b, :, slot] = v[b, :, t]
        self.pos[b, slot] = p

    def update(self, k, v, pos, length: int):
        if k.shape[2] == 1:  # decode: the slot overwritten held p - window, outside the window anyway
            self.write(k, v, pos)
            return self.k, self.v, self.pos
        out = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2), torch.cat([self.pos, pos], 1)
        self.write(k, v, pos)
        return out

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class SlidingCache(ContiguousCache):
    """A contiguous cache whose local layers are rings of `window` slots.
    nbytes() = predict.memory(spec, batch, context=max_len).cache_bytes."""

    name = "sliding"

    @staticmethod
    def _layer(a: Attention, batch: int, max_len: int, dtype, device):
        if a.window and a.window < max_len:
            return RingLayer(a, batch, a.window, dtype, device)
        return ContiguousLayer(a, batch, max_len, dtype, device)
