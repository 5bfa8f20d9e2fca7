"""Channel mixers: gated MLP (SwiGLU / GeGLU: down(act(gate x) * up x)) and plain MLP (GPT-2: proj(act(fc x));
Nemotron-H: down(relu(up x)^2))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.errors import KvwallError
from kvwall.spec.model import MLP

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (Nemotron-H)
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise KvwallError(f"activation {name!r} is not one the engine runs ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """w13 holds [gate; up] fused (one matmul); w2 is down."""

    def __init__(self, spec: MLP, hidden: int):
        super().__init__()
        self.d_ff = spec.d_ff
        self.act = activation(spec.activation)
        self.w13 = nn.Linear(hidden, 2 * spec.d_ff, bias=spec.bias)
        self.w2 = nn.Linear(spec.d_ff, hidden, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.d_ff, dim=-1)  # (B, T, F) each
        return self.w2(self.act(gate) * up)  # (B, T, D)


class PlainMLP(nn.Module):
    def __init__(self, spec: MLP, hidden: int):
        super().__init__()
        self.act = activation(spec.activation)
        self.w1 = nn.Linear(hidden, spec.d_ff, bias=spec.bias)
        self.w2 = nn.Linear(spec.d_ff, hidden, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))  # (B, T, D)


def make_mlp(spec: MLP, hidden: int) -> nn.Module:
    return GatedMLP(spec, hidden) if spec.gated else PlainMLP(spec, hidden)


MIXER = make_mlp  # kvwall.engine.mixers finds it by the spec's kind
