"""The engine's mixers by the spec's ``kind``: the one place that maps a layer's spec to its torch module.

Sequence mixers (SEQUENCE) are SequenceMixer classes (layers/mixer.py): besides the module they
answer, from the spec alone, what the caches and the rotary tables need, so that nothing else in
the engine checks mixer types. Channel mixers (CHANNEL) map to their builders. A new mixer kind is
its layer module plus one line here.
"""

from __future__ import annotations

from torch import nn

from kvwall.engine.layers.attention import Attention
from kvwall.engine.layers.latent import LatentAttention
from kvwall.engine.layers.mamba import Mamba
from kvwall.engine.layers.mamba2 import Mamba2
from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.engine.layers.mlp import make_mlp
from kvwall.engine.layers.moe import MoE
from kvwall.errors import KvwallError
from kvwall.spec.model import ModelSpec

SEQUENCE: dict[str, type[SequenceMixer]] = {"attention": Attention, "latent": LatentAttention, "mamba": Mamba,
                                            "mamba2": Mamba2}
CHANNEL = {"mlp": make_mlp, "moe": MoE}  # (spec, hidden) -> nn.Module


def mixer_class(m) -> type[SequenceMixer]:
    """The engine class of a sequence mixer spec; a one-line error for a kind the engine does not run."""
    if m.kind not in SEQUENCE:
        raise KvwallError(f"the engine does not run {m.kind} layers; it runs {', '.join(SEQUENCE)}")
    return SEQUENCE[m.kind]


def kv_layout(m):
    """The K/V a KV cache holds for a layer with sequence mixer m (None: no mixer, or one with no K/V)."""
    return None if m is None else mixer_class(m).kv_layout(m)


def state_shapes(m):
    """The fixed state shapes of a layer with sequence mixer m (None: no mixer, or one without state)."""
    return None if m is None else mixer_class(m).state_shapes(m)


def rotary(m) -> tuple:
    """(Rope, rotated width) of a layer with sequence mixer m; (None, 0) without rotary positions."""
    return (None, 0) if m is None else mixer_class(m).rotary(m)


def runs(spec: ModelSpec, index: int) -> bool:
    """Whether the engine has a module for every part of layer `index`: a mixer, a channel mixer or both."""
    layer = spec.layers[index]
    mixer_ok = layer.mixer is None or layer.mixer.kind in SEQUENCE
    ffn_ok = layer.ffn is None or layer.ffn.kind in CHANNEL
    return mixer_ok and ffn_ok and (layer.mixer is not None or layer.ffn is not None)


def make_mixer(spec: ModelSpec, index: int) -> nn.Module | None:
    """The layer's sequence mixer (None: a Nemotron-H MLP/MoE block has none)."""
    m = spec.layers[index].mixer
    return None if m is None else mixer_class(m).build(m, spec, index)


def make_ffn(spec: ModelSpec, index: int) -> nn.Module | None:
    """The layer's channel mixer (None: a Mamba block has none)."""
    f = spec.layers[index].ffn
    return None if f is None else CHANNEL[f.kind](f, spec.hidden)
