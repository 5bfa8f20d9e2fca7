"""Fixed-size state for SSM layers (Mamba, Mamba-2), and the model-level cache that pairs it with KV.

Each SSM layer keeps, per sequence, whatever the length:
    conv  (B, C, K)   the last K inputs of the causal conv (C = d_inner; Mamba-2: d_inner + 2·groups·d_state)
    ssm   (B, E, N)   Mamba's h;  (B, H, P, N) Mamba-2's multi-head h
nbytes() is batch x the predictor's fixed_bytes summed over layers, for the element size of `dtype`.

ModelCache is what a model with SSM layers gets from make_cache: the named KV cache for its
attention layers (a hybrid's; none for a pure SSM) and a StateCache for the rest, behind the
one KVCache contract plus ssm(layer), the state an SSM block reads and updates in place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvwall.engine.caches.base import KVCache
from kvwall.engine.mixers import kv_layout, state_shapes
from kvwall.errors import KvwallError
from kvwall.spec.model import ModelSpec


def has_state(spec: ModelSpec) -> bool:
    """Whether any layer's mixer keeps a fixed state (an SSM layer)."""
    return any(state_shapes(layer.mixer) is not None for layer in spec.layers)


def without_state(spec: ModelSpec) -> ModelSpec:
    """The spec as the KV caches see it: SSM layers have no mixer to hold K/V for (a layer with both, Falcon-H1's
    parallel attention + Mamba-2, keeps its mixer: its K/V go to the KV cache, its state to the StateCache)."""
    layers = tuple(replace(layer, mixer=None)
                   if state_shapes(layer.mixer) is not None and kv_layout(layer.mixer) is None else layer
                   for layer in spec.layers)
    return replace(spec, layers=layers)


@dataclass
class LayerState:
    conv: torch.Tensor  # (B, C, K)
    ssm: torch.Tensor  # (B, E, N) or (B, H, P, N)

    @classmethod
    def zeros(cls, shapes: tuple[tuple[int, ...], tuple[int, ...]], batch: int, dtype, device) -> LayerState:
        """shapes: the mixer's state_shapes, (conv, ssm) without the batch dimension."""
        conv, ssm = shapes
        z = lambda shape: torch.zeros(batch, *shape, dtype=dtype, device=device)  # noqa: E731
        return cls(z(conv), z(ssm))

    def reset(self, row: int) -> None:
        self.conv[row].zero_()
        self.ssm[row].zero_()

    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


class StateCache(KVCache):
    """Per SSM layer a LayerState; rows continue where they stopped, a row starting at position 0 restarts."""

    name = "state"

    def __init__(self, spec: ModelSpec, batch: int, dtype=torch.float32, device="cpu"):
        assert batch > 0, batch
        shapes = [state_shapes(layer.mixer) for layer in spec.layers]
        self.layers = [LayerState.zeros(s, batch, dtype, device) if s is not None else None for s in shapes]
        self.seen = [0] * batch  # tokens each row's state has taken in

    def step(self, pos: torch.Tensor) -> None:
        """A state cannot skip or rewind: each row's first valid position must be 0 or where it stopped."""
        counts, firsts = (pos >= 0).sum(1).tolist(), pos[:, 0].tolist()
        for b, (n, first) in enumerate(zip(counts, firsts)):
            if n == 0:
                continue
            if first == 0:
                self.release(b)
            elif first != self.seen[b]:
                raise KvwallError(f"row {b} continues at position {first} but its SSM state holds {self.seen[b]} "
                                  "tokens; an SSM state cannot skip or rewind (start again at position 0)")
            self.seen[b] = first + n

    def ssm(self, layer: int) -> LayerState:
        return self.layers[layer]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers if s is not None)

    def release(self, row: int) -> None:
        """Fixed memory stays allocated; the row's state is zeroed for whatever sequence comes next."""
        for s in self.layers:
            if s is not None:
                s.reset(row)
        self.seen[row] = 0


class ModelCache(KVCache):
    """KV for attention layers (any KVCache) + fixed state for SSM layers, as one cache."""

    def __init__(self, kv: KVCache, state: StateCache):
        self.kv, self.state = kv, state
        self.name = f"{kv.name}+state"

    def step(self, pos):
        self.kv.step(pos)
        self.state.step(pos)

    def update(self, layer, k, v, pos):
        return self.kv.update(layer, k, v, pos)

    def attend(self, layer, q, k, v, pos, scale, window, softcap):
        return self.kv.attend(layer, q, k, v, pos, scale, window, softcap)

    def attend_masked(self, layer, *args, **kw):
        return self.kv.attend_masked(layer, *args, **kw)  # the KV cache's own windows (sliding:W) and sinks

    def ssm(self, layer: int) -> LayerState:
        return self.state.ssm(layer)

    def nbytes(self) -> int:
        return self.kv.nbytes() + self.state.nbytes()

    def release(self, row: int) -> None:
        self.kv.release(row)
        self.state.release(row)
