"""The one contract every KV cache keeps, and the no-cache used for a plain full forward.

    step(pos)                         once per forward pass, before the layers: check bounds, allocate
    update(layer, k, v, pos)          write the new tokens' K/V, return what attention reads:
        k, v:  (B, Hkv, T, D)         the new tokens' keys and values (for MLA: latent c_kv, rope key k_pe)
        pos:   (B, T)                 their positions in each sequence, -1 for padding; a row's valid
                                      tokens come first and are consecutive (right padding)
        -> k_all, v_all: (B, Hkv, S, D)  keys/values of S slots
           k_pos: (B|1, S)               position each slot holds, -1 for an empty slot
    attend(layer, q, k, v, pos, scale, window, softcap)
                                      update(), then softmax attention of q (B, Hq, T, D) over what it
                                      returns -> (B, Hq, T, Dv). A cache that can attend in its own
                                      storage format (the quantized one, at decode) overrides it.
    decode_blocks(batch)              for a step where each row adds one token at its end: a DecodeBlocks (each
                                      layer's KVView: fp32 or fp8 pools, or the KIVI buffers; block table,
                                      lengths), which the fused decode step (engine/decode_stack.py) writes
                                      and reads itself; None (the default) where the cache cannot hand them
                                      over, and for any step it must run itself (a KIVI chunk's flush)
    nbytes()                          bytes of K/V storage held (scales/zero points included, position
                                      bookkeeping excluded): equal to kvwall.predict's figure

The caches stay generic: what they hold for a layer is its mixer's kv_layout (kvwall.engine.mixers),
an Attention spec of K/V heads and widths. MLA (latent attention) layers use the same contract with
one "head" whose k is the latent c_kv (kv_lora_rank wide) and whose v is the shared rope key k_pe
(qk_rope_head_dim wide): the caches that hold K/V by shape (contiguous, sliding, paged) then hold
exactly MLA's latent cache.

A new strategy is a KVCache subclass in its own module plus one line in registry.py; make_cache
builds it through ``create``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvwall.engine.layers.attention import attend, attend_causal, attend_sinks, prefix_start, visible
from kvwall.engine.mixers import kv_layout
from kvwall.errors import KvwallError
from kvwall.spec.model import Attention, ModelSpec


@dataclass(frozen=True)
class KVView:
    """One layer's K/V as the fused decode step (kernels/decode_stack.cpp's KV) writes and reads it in place.

    kind "fp32" / "fp8": k (NB, H, bs, D), v (NB, H, bs, Dv) pools of blocks, fp32 or float8_e4m3fn (written as
    caches/fp8.py writes), read through DecodeBlocks.table; "kivi": a QuantizedLayer's buffers (caches/quantized.py),
    k, v its full-precision residual (rows, H, slots, D|Dv) fp32, the new token going to the residual's next slot;
    "int": an integer pool of serve's (serve/runner.py's QuantizedPages), k, v its codes (NB, H, bs, D|Dv * bits / 8)
    uint8, ks, kz, vs, vz each token's fp16 scales and zero points (NB, H, bs, groups), the new token quantized as
    QuantizedPages.write quantizes it, read through DecodeBlocks.table."""

    kind: str
    k: torch.Tensor
    v: torch.Tensor
    kq: torch.Tensor | None = None  # kivi: packed key chunks, their scales and zero points (None: symmetric)
    ks: torch.Tensor | None = None
    kz: torch.Tensor | None = None
    vq: torch.Tensor | None = None  # kivi: packed values per token, scales, zero points
    vs: torch.Tensor | None = None
    vz: torch.Tensor | None = None
    bits: int = 0  # kivi, int: 8, 4 or 2
    ring: int = 0  # fp32 ring (caches/sliding.py's RingLayer): its window's slots, after `sink` slots; 0: not a ring
    sink: int = 0
    pos: torch.Tensor | None = None  # a ring's (rows, sink + ring) positions per slot, which the step keeps up to date
    window: int | None = None  # the window attention uses, when not the layer's own (0: none)


class KVViews(list):
    """Every layer's KVView, kept by a cache for as long as its buffers stay; `native`: the kernel's copy of them,
    made once by the decode stack (so a step converts nothing)."""

    native = None


class DecodeBlocks(NamedTuple):
    """What decode_blocks hands the fused decode step for one step of B rows."""

    views: KVViews
    table: torch.Tensor  # (B, nb) int64: the pools' block tables (a contiguous cache: row b is block b)
    lengths: torch.Tensor  # (B,) int64: tokens each row holds, its new one (at position lengths - 1) included
    quantized: torch.Tensor | None = None  # (B,) int64: tokens each row holds in quantized chunks (kivi views)
    done: Callable[[], None] | None = None  # called once the step wrote its tokens: the cache's counters follow


class KVCache:
    name = "base"
    _mask_pos: torch.Tensor | None = None  # the pos object the memoised masks belong to (KVCache.mask)
    _masks: dict = {}
    views: KVViews | bool | None = None  # layer_views: made once, or False when some layer has none

    def layer_views(self, make) -> KVViews | None:
        """The fused decode step's views of this cache's layers: make() -> one KVView (or None) per layer, called once
        and kept as long as the cache (the buffers they view are); None when some layer has no view."""
        if self.views is None:
            views = list(make())
            self.views = KVViews(views) if all(views) else False
        return self.views or None

    @classmethod
    def create(cls, choice, spec: ModelSpec, batch: int, max_len: int, dtype, device, **knobs) -> KVCache:
        """make_cache's way in: choice is the parsed name (registry.CacheChoice), knobs the registry entry's
        keywords (block_size, residual). A strategy whose constructor needs more overrides this."""
        return cls(spec, batch, max_len=max_len, dtype=dtype, device=device, **knobs)

    def step(self, pos: torch.Tensor) -> None:
        pass

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
               scale: float, window: int | None, softcap: float | None, sink: int = 0) -> torch.Tensor:
        """`sink`: the first positions a windowed layer keeps seeing (the sliding cache's :sinkS)."""
        k_all, v_all, k_pos = self.update(layer, k, v, pos)  # (B, Hkv, S, D) x2, (B|1, S)
        k_all, v_all = as_dtype(k_all, q.dtype), as_dtype(v_all, q.dtype)
        s0 = None if softcap else prefix_start(pos, k_pos)
        if s0 is not None:  # a first prefill: causal (banded by a window) over the new tokens' own keys
            T = pos.shape[1]
            return attend_causal(q, k_all[:, :, s0:s0 + T], v_all[:, :, s0:s0 + T], scale, window, sink)
        return attend(q, k_all, v_all, self.mask(pos, k_pos, window, sink), scale, softcap)  # (B, Hq, T, Dv)

    def attend_masked(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                      scale: float, window: int | None, chunk: int | None, sinks: torch.Tensor | None,
                      sink: int = 0) -> torch.Tensor:
        """update(), then attention under a rule the in-place kernels do not have: a chunked layer (Llama 4: a query
        sees only the earlier keys of its own chunk of `chunk` positions), through SDPA with its mask; attention
        sinks (gpt-oss: sinks (Hq,), one logit per head that joins the softmax), through attend_sinks
        -> (B, Hq, T, Dv). `sink`: the sliding cache's :sinkS positions, as in attend()."""
        k_all, v_all, k_pos = self.update(layer, k, v, pos)  # (B, Hkv, S, D) x2, (B|1, S)
        k_all, v_all = as_dtype(k_all, q.dtype), as_dtype(v_all, q.dtype)
        mask = visible(pos, k_pos, window, sink, chunk)  # (B, 1, T, S)
        if sinks is None:
            return attend(q, k_all, v_all, mask, scale, None)  # (B, Hq, T, Dv)
        return attend_sinks(q, k_all, v_all, mask, scale, sinks)  # (B, Hq, T, Dv)

    def mask(self, pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, sink: int = 0) -> torch.Tensor | None:
        """visible(pos, k_pos, window, sink), or None where every slot is visible to every query (SDPA then skips
        the mask). Layers of one forward pass get the same pos object and, for the caches whose layers share
        one slot table (contiguous, paged), the same k_pos: the mask is worked out once per pass, not per layer.
        So a cache must not change, within one pass, the positions of a k_pos tensor it has returned."""
        if self._mask_pos is not pos:  # a new forward pass (a new pos object): forget the last one's masks
            self._mask_pos, self._masks = pos, {}
        key = (k_pos.data_ptr(), tuple(k_pos.shape), tuple(k_pos.stride()), window, sink)
        if key not in self._masks:  # k_pos is kept with its mask: no later tensor can take its address
            m = visible(pos, k_pos, window, sink)  # (B, 1, T, S)
            self._masks[key] = (k_pos, None if bool(m.all()) else m)
        return self._masks[key][1]

    def decode_blocks(self, batch: int) -> DecodeBlocks | None:
        return None

    def nbytes(self) -> int:
        raise NotImplementedError

    def release(self, row: int) -> None:
        """A sequence finished: caches that can reuse its memory (paged) do so."""


class NoCache(KVCache):
    """Attention over the new tokens only: a full forward pass without remembering anything."""

    name = "none"

    def update(self, layer, k, v, pos):
        return k, v, pos

    def nbytes(self) -> int:
        return 0


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, without a dispatch when it already is (most caches hold the compute dtype)."""
    return x if x.dtype == dtype else x.to(dtype)


def attention_specs(spec: ModelSpec) -> list[Attention | None]:
    """Per layer: the K/V its mixer keeps (an Attention spec: heads and widths; MLA's latent and rope key
    as one head) or None (no mixer; an SSM layer, whose fixed state is state.py's)."""
    return [kv_layout(layer.mixer) for layer in spec.layers]


def valid_tokens(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, position) of every non-padding token in pos (B, T)."""
    b, t = (pos >= 0).nonzero(as_tuple=True)  # (N,), (N,)
    return b, t, pos[b, t]


def check_length(pos: torch.Tensor | int, max_len: int, what: str) -> int:
    """The longest sequence after this step (pos, or its largest position); a one-line error past the
    cache's maximum."""
    end = (pos if isinstance(pos, int) else int(pos.max())) + 1
    if end > max_len:
        raise KvwallError(f"position {end - 1} is past the {what} cache's maximum of {max_len} tokens; "
                          "make the cache longer (max length) or the request shorter")
    return end
