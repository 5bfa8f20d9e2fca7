"""The engine's mixers by the spec's ``kind``: the one place that maps a layer's spec to its torch module.

Each kind has its module, ``kvwall/engine/layers/<kind>.py`` (attention, latent, mamba, mamba2; channel
mixers mlp, moe), which ends with ``MIXER = <the class or builder>``. Sequence mixers are SequenceMixer
classes (layers/mixer.py): besides the module they answer, from the spec alone, what the caches, the
rotary tables and the checkpoint loader need, so nothing else in the engine checks mixer types. A new
mixer kind is its layer module and nothing else here.
"""

from __future__ import annotations

import importlib
from functools import cache

from torch import nn

from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.errors import KvwallError
from kvwall.spec.model import ModelSpec


@cache
def _found(kind: str):
    """The MIXER of layers/<kind>.py, or None when the engine has no module for that kind."""
    try:
        module = importlib.import_module(f"kvwall.engine.layers.{kind}")
    except ModuleNotFoundError:
        return None
    return getattr(module, "MIXER", None)


def mixer_class(m) -> type[SequenceMixer]:
    """The engine class of a sequence mixer spec; a one-line error for a kind the engine does not run."""
    cls = _found(m.kind)
    if cls is None:
        raise KvwallError(f"the engine does not run {m.kind} layers (no kvwall/engine/layers/{m.kind}.py)")
    return cls


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
    mixer_ok = layer.mixer is None or _found(layer.mixer.kind) is not None
    ffn_ok = layer.ffn is None or _found(layer.ffn.kind) is not None
    return mixer_ok and ffn_ok and (layer.mixer is not None or layer.ffn is not None)


def make_mixer(spec: ModelSpec, index: int) -> nn.Module | None:
    """The layer's sequence mixer (None: a Nemotron-H MLP/MoE block has none)."""
    m = spec.layers[index].mixer
    return None if m is None else mixer_class(m).build(m, spec, index)


def make_ffn(spec: ModelSpec, index: int) -> nn.Module | None:
    """The layer's channel mixer (None: a Mamba block has none)."""
    f = spec.layers[index].ffn
    return None if f is None else _found(f.kind)(f, spec.hidden)
