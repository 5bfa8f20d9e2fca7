"""Contiguous cache: every layer preallocates K and V for max_len tokens (static addresses, gpt-fast style).

Slot j of a row holds position j. nbytes() is the whole preallocation:
batch x max_len x n_kv x (head_dim + v_head_dim) x element size, summed over layers
(= predict.memory(spec.with_window(None), batch, context=max_len).cache_bytes).
"""

from __future__ import annotations

import torch

from kvwall.engine.caches.base import (
    DecodeBlocks,
    KVCache,
    KVView,
    attention_specs,
    check_length,
    valid_tokens,
)
from kvwall.engine.caches.paged_kernel import attend_blocks, in_place_kernel
from kvwall.spec.model import Attention, ModelSpec


class ContiguousLayer:
    def __init__(self, attn: Attention, batch: int, max_len: int, dtype, device):
        self.k = torch.zeros(batch, attn.n_kv_heads, max_len, attn.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, attn.n_kv_heads, max_len, attn.v_head_dim, dtype=dtype, device=device)
        self.slots = torch.arange(max_len, device=device)[None]  # (1, max_len): slot j holds position j

    def update(self, k, v, pos, length: int, at: int | None = None):
        """Write the new tokens; `at`: every row's one new token is at that position (the cache knows it
        from step()), so the write is one slice copy per tensor, with no index tensors."""
        if at is not None:
            self.k[:, :, at:at + 1] = k  # (B, Hkv, 1, D)
            self.v[:, :, at:at + 1] = v
        elif pos.shape[1] == 1 and bool((pos >= 0).all()):  # decode, rows at different positions
            rows = torch.arange(pos.shape[0], device=pos.device)
            self.k[rows, :, pos[:, 0]] = k[:, :, 0]  # (B, Hkv, D)
            self.v[rows, :, pos[:, 0]] = v[:, :, 0]
        else:
            b, t, p = valid_tokens(pos)
            self.k[b, :, p] = k[b, :, t]  # (N, Hkv, D)
            self.v[b, :, p] = v[b, :, t]
        return self.k[:, :, :length], self.v[:, :, :length], self.slots[:, :length]

    def view(self) -> KVView | None:
        """This layer as the fused decode step's pools (row b is block b of max_len slots), or None: fp32 only here
        (a subclass that stores otherwise, a ring or fp8, says itself what it hands over)."""
        ok = type(self) is ContiguousLayer and self.k.dtype == self.v.dtype == torch.float32
        return KVView("fp32", self.k, self.v) if ok else None

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class ContiguousCache(KVCache):
    """nbytes() = predict.memory(spec.with_window(None), batch, context=max_len).cache_bytes."""

    name = "contiguous"

    def __init__(self, spec: ModelSpec, batch: int, max_len: int, dtype=torch.float32, device="cpu"):
        assert batch > 0 and max_len > 0, (batch, max_len)
        self.max_len = max_len
        self.length = 0  # longest row so far: attention reads slots [0, length)
        self.at = None  # this step's one position shared by every row's one new token, else None
        self.rows = torch.arange(batch, device=device)[:, None]  # (B, 1): row b is "block" b (attend's kernel)
        self.lengths = None  # (B,) at + 1 when `at` is set: the tokens every row holds
        self.ends = None  # (B,) each row's one new position + 1 at a decode step without padding rows, else None
        self.layers = [self._layer(a, batch, max_len, dtype, device) if a else None for a in attention_specs(spec)]
        slots = torch.arange(max_len, device=device)[None]  # (1, max_len)
        for layer in self.layers:  # one slot table for all: KVCache.mask then works once per forward pass
            if isinstance(layer, ContiguousLayer):
                layer.slots = slots

    @staticmethod
    def _layer(a: Attention, batch: int, max_len: int, dtype, device):
        """The storage of one attention layer (SlidingCache gives local layers a ring instead)."""
        return ContiguousLayer(a, batch, max_len, dtype, device)

    def step(self, pos):
        lo, hi = (int(x) for x in pos.aminmax())  # one pass over pos for both bounds
        self.length = max(self.length, check_length(hi, self.max_len, self.name))
        self.at = hi if pos.shape[1] == 1 and lo == hi >= 0 else None
        self.lengths = None if self.at is None else torch.full((pos.shape[0],), self.at + 1, device=pos.device)
        self.ends = self.lengths if self.at is not None else pos[:, 0] + 1 if pos.shape[1] == 1 and lo >= 0 else None

    def update(self, layer, k, v, pos):
        store = self.layers[layer]
        if self.at is not None and isinstance(store, ContiguousLayer):
            return store.update(k, v, pos, self.length, self.at)
        return store.update(k, v, pos, self.length)

    def attend(self, layer, q, k, v, pos, scale, window, softcap, sink: int = 0):
        """A decode step with every row's new token at one position reads each row's K/V in place with the paged
        kernel (a row is one block of max_len slots, all of slots 0..at written); else KVCache.attend (SDPA)."""
        store = self.layers[layer]
        kernel = self.decode_kernel(q, store, softcap, sink) if type(store) is ContiguousLayer else None
        if kernel is None:
            return super().attend(layer, q, k, v, pos, scale, window, softcap, sink)
        store.update(k, v, pos, self.length, self.at)
        return self.attend_rows(kernel, q, store, self.lengths, window, scale)

    def decode_kernel(self, q, store, softcap, sink: int):
        """The paged decode kernel for this step's layer `store`, or None: only when every row's one new token is at
        one position (`at`), and with one (row, KV head) job per thread at least, since the kernel runs a job per
        thread: MQA at batch 1 (one KV head) took 57.2 / 102.3 ms a step at 16k / 32k through it on 2 threads,
        44.8 / 62.5 through SDPA, which splits the sequence (kvwall bench, 2026-12-03)."""
        if self.at is None or q.shape[0] * store.k.shape[1] < torch.get_num_threads():
            return None
        return in_place_kernel(q, store.k, softcap, sink)

    def decode_blocks(self, batch: int) -> DecodeBlocks | None:
        """Each row is one block of max_len slots (as attend_rows reads it), at a step where every row adds one token
        at its own position (no padding row: a row at -1 would have the kernel write slot -1): row b then holds slots
        0 .. pos[b], as the layers' mask (k_pos <= pos) sees them."""
        if self.ends is None:
            return None
        views = self.layer_views(self.views_of_layers)
        return DecodeBlocks(views, self.rows[:batch], self.ends) if views else None

    def views_of_layers(self) -> list:
        """Each layer's KVView (None where it has none), made once (layer_views)."""
        return [None if layer is None else layer.view() for layer in self.layers]

    def attend_rows(self, kernel, q, store, lengths, window, scale):
        """q (B, Hq, 1, D) over the first lengths[b] slots of each row of `store` -> (B, Hq, 1, Dv)."""
        B = q.shape[0]
        return attend_blocks(kernel, q, store.k[:B], store.v[:B], self.rows[:B], lengths, window, scale)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers if layer is not None)
