"""What every sequence mixer of the engine answers from its spec alone, for the caches and the rotary tables.

The caches never look at mixer types: they ask the layer's class (through kvwall.engine.mixers)
    kv_layout(m)     the K/V a KV cache holds for the layer, as an Attention spec, or None
    state_shapes(m)  the fixed per-sequence state, ((conv shape), (ssm shape)) without the batch, or None
    rotary(m)        (Rope, rotated width) of the rotary table the layer reads, or (None, 0)
and build(m, spec, index) makes the torch module for layer `index` of the model spec, and
    checkpoint_names(m, hf, me, fused)  engine parameter name -> the Hugging Face tensors it is made of
                     (concatenated along dim 0), for a layer whose tensors sit under `hf` (the engine's under `me`)
    hf_module        where a llama-layout checkpoint keeps the mixer under its layer ("self_attn.")
A module may also offer its weights to the fused decode step (engine/decode_stack.py):
    stack_parts()    its part of one C++ layer, or None (the default: the layer runs module by module)
Each mixer module ends with ``MIXER = <its class>``: kvwall.engine.mixers finds it by the spec's kind.
"""

from __future__ import annotations

from torch import nn


def ssm_names(m, extra: list[str], hf: str, me: str) -> dict[str, tuple[str, ...]]:
    """An SSM mixer's tensors: the engine keeps Hugging Face's names under the mixer."""
    names = ["in_proj.weight", "conv1d.weight", "A_log", "D", "out_proj.weight", *extra]
    names += ["conv1d.bias"] if m.conv_bias else []
    names += ["in_proj.bias", "out_proj.bias"] if m.proj_bias else []
    return {me + n: (hf + n,) for n in names}


class SequenceMixer(nn.Module):
    """Defaults: no K/V, no fixed state, no rotary positions (each mixer overrides what it has)."""

    hf_module = "self_attn."  # where a llama-layout checkpoint keeps the mixer under its layer (load.py)

    @classmethod
    def build(cls, m, spec, index: int) -> SequenceMixer:
        raise NotImplementedError

    @staticmethod
    def checkpoint_names(m, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
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

    def stack_parts(self) -> dict | None:
        return None
