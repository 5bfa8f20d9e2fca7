"""LFM2's short convolution: a gated, depthwise causal convolution of a few taps, no recurrence.

transformers 5.25's Lfm2ShortConv (its torch path, causal_conv1d_fn / causal_conv1d_update):

    [B; C; x] = in_proj(u)                    B, C, x: (B, T, W), W = hidden_size
    v   = B * x                               (B, T, W): the input gate
    y_t = Σ_{k<L} w[:, k] v_{t-L+1+k}         (B, T, W): depthwise causal conv of L = conv_L_cache taps
    out = out_proj(C * y)                     (B, T, hidden): the output gate

Its decode state is the conv's last L inputs per channel, (W, L) per sequence, as transformers keeps it (the
oldest of the L is never read again: L - 1 would do). It sits in the state cache as a LayerState whose ssm part is
empty (shape (0,)), so nbytes() is W x L elements, predict/mixers/short_conv.py's fixed_bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from kvwall.engine.layers.mamba import causal_conv
from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.spec.model import ShortConv as ShortConvSpec


class ShortConv(SequenceMixer):
    """Parameter names are Hugging Face's (in_proj, conv, out_proj), under the layer's conv."""

    hf_module = "conv."  # LFM2: model.layers.N.conv.*

    @classmethod
    def build(cls, m: ShortConvSpec, spec, index: int) -> ShortConv:
        return cls(m, spec.hidden, index)

    @staticmethod
    def checkpoint_names(m: ShortConvSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        names = ["in_proj.weight", "conv.weight", "out_proj.weight"]
        names += ["in_proj.bias", "conv.bias", "out_proj.bias"] if m.bias else []  # conv_bias: all three
        return {me + n: (hf + n,) for n in names}

    @staticmethod
    def state_shapes(m: ShortConvSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (m.width, m.l_cache), (0,)  # conv (W, L); no recurrent state

    def __init__(self, spec: ShortConvSpec, hidden: int, index: int):
        super().__init__()
        self.index = index  # which layer of the state cache this block reads and writes
        W = spec.width
        self.in_proj = nn.Linear(hidden, 3 * W, bias=spec.bias)
        self.conv = nn.Conv1d(W, W, spec.l_cache, groups=W, bias=spec.bias)
        self.out_proj = nn.Linear(W, hidden, bias=spec.bias)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope, cache) -> torch.Tensor:
        state = cache.ssm(self.index)  # conv (B, W, L)
        Bg, Cg, u = self.in_proj(x).chunk(3, dim=-1)  # (B, T, W) each
        y = causal_conv(Bg * u, state.conv, self.conv, (pos >= 0).sum(1))  # (B, T, W); right padding is not read
        return self.out_proj(Cg * y)  # (B, T, hidden)


MIXER = ShortConv  # kvwall.engine.mixers finds it by the spec's kind
