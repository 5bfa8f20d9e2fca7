"""Sliding-window cache: local layers keep a ring buffer of `window` slots, global layers a contiguous buffer.

Position p lives in ring slot p % window. Memory stops growing at the window while
attention stays exact: a query at p only sees keys with p - j < window, and those are
exactly the last `window` positions. A multi-token step (prefill) longer than the
window must see keys the ring is about to overwrite, so it attends over
[old ring ; new tokens] and then keeps only the newest `window` tokens.

What-if windows and attention sinks (registry: sliding:W, sliding:W:sinkS):
* ``sliding:W`` runs the model as registry.sliding_spec makes it: W replaces the window of the layers that
  have one (Gemma 3's local layers; its global ones stay global), or goes on every attention layer of a
  model without any. Attention uses W, whatever window the layer itself was built with.
* ``:sinkS`` (StreamingLLM, Xiao et al. 2023) keeps the first S positions beside the ring: S sink slots
  (slot j holds position j < S) then W ring slots (position p >= S in slot S + (p - S) % W). A query at p
  sees j <= p when p - j < W or j < S (attention.visible). Keys keep the positions they were written at
  (rotary applied before caching); StreamingLLM's re-numbering inside the cache is not done.

A chunked layer (Llama 4, chunk C) is a ring of C slots: a query at p sees only p // C * C .. p, all among the last
C positions, so the ring holds min(max_len, C) tokens, what the predictor counts for it (the worst case in a chunk).

nbytes() = predict.memory(spec with window W + S on its windowed layers, batch, context=max_len).cache_bytes.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvwall.engine.caches.base import KVView, attention_specs
from kvwall.engine.caches.contiguous import ContiguousCache, ContiguousLayer
from kvwall.engine.caches.registry import sliding_spec
from kvwall.spec.model import Attention, ModelSpec


class RingLayer:
    def __init__(self, attn: Attention, batch: int, window: int, dtype, device, sink: int = 0, chunked: bool = False):
        self.window, self.sink, self.chunked = window, sink, chunked  # chunked: a query sees only its chunk's slots
        slots = sink + window
        self.k = torch.zeros(batch, attn.n_kv_heads, slots, attn.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, attn.n_kv_heads, slots, attn.v_head_dim, dtype=dtype, device=device)
        self.pos = torch.full((batch, slots), -1, dtype=torch.long, device=device)  # position in each slot

    def write(self, k, v, pos):
        end = pos.max(dim=1, keepdim=True).values + 1  # (B, 1)
        keep = (pos >= 0) & ((pos >= end - self.window) | (pos < self.sink))  # (B, T): the tokens the ring keeps
        b, t = keep.nonzero(as_tuple=True)
        p = pos[b, t]
        # distinct within a row: sinks by position, the rest at most `window` consecutive positions
        slot = torch.where(p < self.sink, p, self.sink + (p - self.sink) % self.window)
        self.k[b, :, slot] = k[b, :, t]  # (N, Hkv, D)
        self.v[b, :, slot] = v[b, :, t]
        self.pos[b, slot] = p

    def write_at(self, k, v, at: int) -> int:
        """Decode with every row's one new token at position `at` (no sinks): one slice write per tensor ->
        the slots every row now holds, min(at + 1, window), all of them inside the window."""
        slot = at % self.window
        self.k[:, :, slot:slot + 1] = k  # (B, Hkv, 1, D)
        self.v[:, :, slot:slot + 1] = v
        self.pos[:, slot] = at
        return min(at + 1, self.window)

    def update(self, k, v, pos, length: int):
        if k.shape[2] == 1:  # decode: the slot overwritten held p - window, outside the window anyway
            self.write(k, v, pos)
            return self.k, self.v, self.pos
        out = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2), torch.cat([self.pos, pos], 1)
        self.write(k, v, pos)
        return out

    def view(self) -> KVView | None:
        """The ring as the fused decode step writes and reads it (kernels/decode_stack.cpp's KV: ring, sink, pos)."""
        ok = self.k.dtype == self.v.dtype == torch.float32 and not self.chunked
        return KVView("fp32", self.k, self.v, ring=self.window, sink=self.sink, pos=self.pos) if ok else None

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class SlidingCache(ContiguousCache):
    """A contiguous cache whose windowed layers are rings of `window` (+ `sink`) slots.
    nbytes() = registry.windowed_bytes: predict.memory with each windowed layer holding min(max_len, W + S)."""

    name = "sliding"

    @classmethod
    def create(cls, choice, spec, batch, max_len, dtype, device) -> SlidingCache:
        """From the registry: sliding:W re-windows the spec (registry.sliding_spec), :sinkS adds sinks."""
        run, sink = sliding_spec(spec, choice)
        return cls(run, batch, max_len, dtype, device, sink)

    def __init__(self, spec: ModelSpec, batch: int, max_len: int, dtype=torch.float32, device="cpu", sink: int = 0):
        self.sink = sink
        super().__init__(spec, batch, max_len, dtype, device)
        self.windows = [a.window if a else None for a in attention_specs(spec)]  # what attention uses, per layer
        self.chunks = [a.chunk if a else None for a in attention_specs(spec)]  # None where sliding:W replaced it

    def _layer(self, a: Attention, batch: int, max_len: int, dtype, device):
        if a.window and a.window + self.sink < max_len:
            return RingLayer(a, batch, a.window, dtype, device, self.sink)
        if a.chunk and a.chunk < max_len:  # a query at p sees p // C * C .. p: at most C positions, the last C
            return RingLayer(a, batch, a.chunk, dtype, device, chunked=True)
        return ContiguousLayer(a, batch, max_len, dtype, device)

    def views_of_layers(self) -> list:
        """Rings as rings; a contiguous layer here sees every token it holds (window 0), whatever the model's layer
        says: it has no window, or the cache's window + sinks cover max_len (else it would be a ring), and this
        cache's window, not the layer's own, is what attention uses (sliding:W on Gemma 3 at W >= max_len)."""
        views = super().views_of_layers()
        return [replace(v, window=0) if isinstance(layer, ContiguousLayer) and v is not None else v
                for layer, v in zip(self.layers, views, strict=True)]

    def attend_masked(self, layer, q, k, v, pos, scale, window, chunk, sinks):
        """With this cache's window, chunk and sinks for the layer (sliding:W replaces a chunk with its window)."""
        w = self.windows[layer]
        return super().attend_masked(layer, q, k, v, pos, scale, w, self.chunks[layer], sinks, self.sink if w else 0)

    def attend(self, layer, q, k, v, pos, scale, window, softcap, sink=0):
        """With this cache's window for the layer (sliding:W replaces the layer's own) and its sinks. A ring's decode
        step (no sinks, every row at one position) goes through the paged kernel too: its slots hold exactly the
        positions in the window, in some order, and attention does not depend on the keys' order."""
        w = self.windows[layer]
        store = self.layers[layer]
        kernel = (self.decode_kernel(q, store, softcap, 0)
                  if isinstance(store, RingLayer) and not store.sink else None)
        if kernel is None:
            return super().attend(layer, q, k, v, pos, scale, w, softcap, self.sink if w else 0)
        held = store.write_at(k, v, self.at)
        lengths = torch.full((q.shape[0],), held, device=q.device)
        return self.attend_rows(kernel, q, store, lengths, None, scale)
