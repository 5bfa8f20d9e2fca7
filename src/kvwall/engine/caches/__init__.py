"""KV caches: one contract (base.KVCache), one class per strategy.

    contiguous   preallocated to max_len for every layer
    sliding      ring buffer of `window` slots on local layers, contiguous on global ones
    int8/int4/int2  KIVI-style quantized (keys per channel, values per token, fp residual)
    paged        blocks from a pool, per-row block tables, freed when a sequence finishes
Models with SSM layers (Mamba, Mamba-2, hybrids) get a state.ModelCache: the named cache for
their attention layers (none for a pure SSM) plus a fixed-size state for each SSM layer.
"""

from __future__ import annotations

import torch

from kvwall.engine import CACHE_NAMES
from kvwall.engine.caches.base import KVCache, NoCache
from kvwall.engine.caches.contiguous import ContiguousCache
from kvwall.engine.caches.paged import PagedCache
from kvwall.engine.caches.quantized import QuantizedCache
from kvwall.engine.caches.sliding import SlidingCache
from kvwall.engine.caches.state import ModelCache, StateCache, has_state, without_state
from kvwall.errors import KvwallError
from kvwall.predict.formats import get_format
from kvwall.spec.model import ModelSpec



def make_cache(name: str, spec: ModelSpec, batch: int, max_len: int, dtype=torch.float32, device="cpu",
               block_size: int = 16, residual: int = 32) -> KVCache:
    """A cache by name; quantized names take format options (``int8:g32``)."""
    base = name.split(":")[0]
    if has_state(spec) and base in CACHE_NAMES:
        attn = without_state(spec)
        kv = make_cache(name, attn, batch, max_len, dtype, device, block_size, residual) \
            if attn.attention_layers() else NoCache()
        return ModelCache(kv, StateCache(spec, batch, dtype, device))
    if base == "contiguous":
        return ContiguousCache(spec, batch, max_len, dtype, device)
    if base == "sliding":
        return SlidingCache(spec, batch, max_len, dtype, device)
    if base in ("int8", "int4", "int2"):
        return QuantizedCache(spec, batch, max_len, get_format(name), residual, dtype, device)
    if base == "paged":
        return PagedCache(spec, batch, block_size, None, max_len, dtype, device)
    raise KvwallError(f"unknown cache {name!r}; caches: {', '.join(CACHE_NAMES)}")


__all__ = ["CACHE_NAMES", "KVCache", "NoCache", "make_cache", "ContiguousCache", "SlidingCache",
           "QuantizedCache", "PagedCache", "ModelCache", "StateCache"]
