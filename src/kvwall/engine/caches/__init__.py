"""KV caches: one contract (base.KVCache), one module per strategy, one registry (registry.py) naming them
(contiguous, sliding, the KIVI-style int8/int4/int2, paged: registry.CACHES says what each holds).

Models with SSM layers (Mamba, Mamba-2, hybrids) get a state.ModelCache: the named cache for
their attention layers (none for a pure SSM) plus a fixed-size state for each SSM layer.

This package imports without torch (the CLI reads the registry); the cache classes, and torch
with them, load on first use.
"""

from __future__ import annotations

from importlib import import_module

from kvwall.engine.caches.registry import BLOCK_SIZE, CACHE_NAMES, CACHES, RESIDUAL, CacheChoice, parse_cache

_SHARED = {"KVCache": "base", "NoCache": "base", "ModelCache": "state", "StateCache": "state"}  # not strategies


def make_cache(name: str | CacheChoice, spec, batch: int, max_len: int, dtype=None, device="cpu",
               block_size: int = BLOCK_SIZE, residual: int = RESIDUAL):
    """A cache by registry name; quantized names take format options (``int8:g32``); dtype None is float32.
    Each strategy gets the keywords its registry entry lists (block_size, residual)."""
    import torch

    from kvwall.engine.caches.base import NoCache
    from kvwall.engine.caches.state import ModelCache, StateCache, has_state, without_state

    choice, dtype = parse_cache(name), dtype or torch.float32
    if has_state(spec):  # the named cache for the attention layers, a fixed state for the SSM ones
        attn = without_state(spec)
        kv = _strategy(choice, attn, batch, max_len, dtype, device, block_size, residual) \
            if attn.attention_layers() else NoCache()
        return ModelCache(kv, StateCache(spec, batch, dtype, device))
    return _strategy(choice, spec, batch, max_len, dtype, device, block_size, residual)


def _strategy(choice, spec, batch, max_len, dtype, device, block_size, residual):
    """The named strategy's cache for the K/V of `spec` (a layer that also keeps a state, Falcon-H1's parallel
    one, is still in it: make_cache must not look for state again)."""
    knobs = choice.entry.take(block_size=block_size, residual=residual)
    return choice.entry.load().create(choice, spec, batch, max_len, dtype, device, **knobs)


def __getattr__(name: str):
    """The cache classes, imported on first use: kvwall.engine.caches.ContiguousCache and the like."""
    if name in _SHARED:
        return getattr(import_module(f"kvwall.engine.caches.{_SHARED[name]}"), name)
    for entry in CACHES.values():
        if entry.cls.endswith(":" + name):
            return entry.load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CACHE_NAMES", "CACHES", "CacheChoice", "parse_cache", "make_cache"]
