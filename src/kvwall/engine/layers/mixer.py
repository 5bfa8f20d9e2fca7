"""What every sequence mixer of the engine answers from its spec alone, for the caches and the rotary tables.

The caches never look at mixer types: they ask the layer's class (through kvwall.engine.mixers)
    kv_layout(m)     the K/V a KV cache holds for the layer, as an Attention spec, or None
    state_shapes(m)  the fixed per-sequence state, ((conv shape), (ssm shape)) without the batch, or None
    rotary(m)        (Rope, rotated width) of the rotary table the layer reads, or (None, 0)
and build(m, spec, index) makes the torch module for layer `index` of the model spec.
"""

from __future__ import annotations

from torch import nn


class SequenceMixer(nn.Module):
    """Defaults: no K/V, no fixed state, no rotary positions (each mixer overrides what it has)."""

    @classmethod
    def build(cls, m, spec, index: int) -> "SequenceMixer":
        raise NotImplementedError

    @staticmethod
    def kv_layout(m):
        return None

    @staticmethod
    def state_shapes(m) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        return None

    @staticmethod
    def rotary(m) -> tuple:
        return None, 0
