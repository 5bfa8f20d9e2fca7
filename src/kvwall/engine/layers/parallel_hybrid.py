"""Falcon-H1's parallel layer: softmax attention and Mamba-2 side by side on the same normed input, summed.

transformers 5.25's FalconH1DecoderLayer, with its muP multipliers (FalconH1Config, each 1.0 by default):

    n   = input_layernorm(x)                                   (B, T, D)
    m   = Mamba2(n * ssm_in) * ssm_out                         in_proj's parts z, x, B, C, Δ each times its
                                                               ssm_multipliers entry (Mamba2.in_scale)
    a   = Attention(n * attention_in) * attention_out          k times key_multiplier: folded into the softmax
                                                               scale by the parser (q · mk = m (q · k))
    x   = x + m + a                                            then the MLP as in any block

The layer holds both caches: its K/V in the KV cache (kv_layout: the attention part) and its conv and SSM state
in the state cache (state_shapes: the Mamba-2 part), each at the layer's own index, so ModelCache serves it as
it serves a hybrid whose layers have one or the other.
"""

from __future__ import annotations

import torch

from kvwall.engine.layers.attention import Attention
from kvwall.engine.layers.mamba2 import Mamba2
from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.spec.model import ParallelHybrid as ParallelHybridSpec


class ParallelHybrid(SequenceMixer):
    """attn (an Attention) and mamba (a Mamba2); Hugging Face keeps them under self_attn. and mamba."""

    hf_module = ""  # both parts sit directly under the layer: model.layers.N.{self_attn, mamba}.*

    @classmethod
    def build(cls, m: ParallelHybridSpec, spec, index: int) -> ParallelHybrid:
        return cls(m, Attention.build(m.attention, spec, index), Mamba2.build(m.mamba, spec, index))

    @staticmethod
    def checkpoint_names(m: ParallelHybridSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        return (Attention.checkpoint_names(m.attention, hf + "self_attn.", me + "attn.", fused)
                | Mamba2.checkpoint_names(m.mamba, hf + "mamba.", me + "mamba."))

    @staticmethod
    def kv_layout(m: ParallelHybridSpec):
        return Attention.kv_layout(m.attention)

    @staticmethod
    def state_shapes(m: ParallelHybridSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return Mamba2.state_shapes(m.mamba)

    @staticmethod
    def rotary(m: ParallelHybridSpec) -> tuple:
        return Attention.rotary(m.attention)

    def __init__(self, spec: ParallelHybridSpec, attn: Attention, mamba: Mamba2):
        super().__init__()
        self.attn, self.mamba = attn, mamba
        self.attention_in, self.attention_out = spec.attention_in, spec.attention_out
        self.ssm_in, self.ssm_out = spec.ssm_in, spec.ssm_out

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope, cache) -> torch.Tensor:
        m = self.mamba(x * self.ssm_in, pos, rope, cache) * self.ssm_out  # (B, T, D)
        a = self.attn(x * self.attention_in, pos, rope, cache) * self.attention_out  # (B, T, D)
        return m + a  # (B, T, D)


MIXER = ParallelHybrid  # kvwall.engine.mixers finds it by the spec's kind
