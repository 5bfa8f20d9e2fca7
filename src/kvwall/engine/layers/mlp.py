"""Channel mixers: gated MLP (SwiGLU / GeGLU: down(act(gate x) * up x)) and plain MLP (GPT-2: proj(act(fc x));
Nemotron-H: down(relu(up x)^2))."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.native import compiled
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


@functools.lru_cache(maxsize=1)
def silu_mul_kernel():
    """The compiled ``silu_mul`` of kernels/fused_ops.cpp (silu(gate) * up from [gate, up]), or None.
    Why: SwiGLU's split, silu and multiply are three dispatches over 2 x 1536 floats; at batch 16 on SmolLM2 silu
    and mul took 1.5 ms of a 62 ms fp32 decode step (benchmarks/profile_decode.py, 2026-12-03)."""
    return compiled("fused_ops", "silu_mul", "torch's silu and mul")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation (transformers' GptOssExperts._apply_gate): gate clamped above at limit, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate) (alpha 1.702, limit 7.0 in gpt-oss)."""
    gate = gate.clamp(max=limit)  # (..., F)
    up = up.clamp(min=-limit, max=limit)  # (..., F)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))  # (..., F)


class GatedMLP(nn.Module):
    """w13 holds [gate; up] fused (one matmul); w2 is down. swiglu (alpha, limit): gpt-oss's clamped SwiGLU, for
    activation "clamped_swiglu"."""

    def __init__(self, spec: MLP, hidden: int, swiglu: tuple[float, float] | None = None):
        super().__init__()
        self.d_ff = spec.d_ff
        self.swiglu = swiglu if spec.activation == "clamped_swiglu" else None
        self.act = activation(spec.activation) if self.swiglu is None else None
        self.activation = spec.activation
        self.multipliers = spec.multipliers  # Falcon-H1: (on the gate before the activation, on the output)
        self.w13 = nn.Linear(hidden, 2 * spec.d_ff, bias=spec.bias)
        self.w2 = nn.Linear(spec.d_ff, hidden, bias=spec.bias)
        self.eager = False  # True: the reference ops only (Transformer.set_eager)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.w13(x)  # (B, T, 2F): [gate, up]
        if self.multipliers != (1.0, 1.0):  # FalconH1MLP: down(up * act(gate * m_gate)) * m_down
            gate, up = gu.split(self.d_ff, dim=-1)  # (B, T, F) each
            return self.w2(up * self.act(gate * self.multipliers[0])) * self.multipliers[1]  # (B, T, D)
        kernel = self.kernel(gu)
        if kernel is not None:
            return self.w2(kernel(gu))  # (B, T, D)
        gate, up = gu.split(self.d_ff, dim=-1)  # (B, T, F) each
        if self.swiglu is not None:
            return self.w2(clamped_swiglu(gate, up, *self.swiglu))  # (B, T, D)
        return self.w2(self.act(gate) * up)  # (B, T, D)

    def stack_parts(self) -> dict | None:
        """This layer's part of the fused decode step (engine/decode_stack.py): SwiGLU or GeGLU (tanh)."""
        if self.activation not in ("silu", "gelu_tanh") or self.multipliers != (1.0, 1.0):
            return None
        return dict(up=self.w13, down=self.w2, gelu=self.activation == "gelu_tanh")

    def kernel(self, gu: torch.Tensor):
        """silu_mul for SwiGLU's fast path on fp32 CPU tensors outside autograd, else None (torch's ops)."""
        if self.eager or self.activation != "silu" or gu.dtype != torch.float32 or gu.device.type != "cpu":
            return None
        return None if torch.is_grad_enabled() and gu.requires_grad else silu_mul_kernel()


class PlainMLP(nn.Module):
    def __init__(self, spec: MLP, hidden: int):
        super().__init__()
        self.act = activation(spec.activation)
        self.w1 = nn.Linear(hidden, spec.d_ff, bias=spec.bias)
        self.w2 = nn.Linear(spec.d_ff, hidden, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))  # (B, T, D)


def make_mlp(spec: MLP, hidden: int, swiglu: tuple[float, float] | None = None) -> nn.Module:
    return GatedMLP(spec, hidden, swiglu) if spec.gated else PlainMLP(spec, hidden)


MIXER = make_mlp  # kvwall.engine.mixers finds it by the spec's kind
