"""A decoder-only transformer built from a ModelSpec (gpt-fast style: the whole model in one sitting).

    tokens (B, T), pos (B, T) -> embed (* embed_scale) (+ learned positions)
      -> for each layer: x += [post_norm](attn(norm(x)));  x += [post_norm](mlp(norm(x)))   (either may be absent)
      -> final norm -> lm_head (tied to the embedding or not) -> [softcap] -> logits (B, T, V)

``attn`` is the layer's sequence mixer (attention, MLA, Mamba or Mamba-2); Mamba blocks have no
``mlp``, and Nemotron-H blocks have one or the other (mixer-only or MLP/MoE-only, one norm each).
Attention layers read and write K/V through the cache; SSM layers their fixed state.

``pos`` holds each token's position in its own sequence (-1 for padding): batches of
prompts of different lengths are right-padded and every row keeps its true positions, so
rotary and learned positions are exactly those of an unpadded run.
"""

from __future__ import annotations

import torch
from torch import nn

from kvwall.engine.caches.base import NoCache
from kvwall.engine.caches.state import ModelCache, StateCache, has_state
from kvwall.engine.layers.attention import Attention
from kvwall.engine.layers.latent import LatentAttention
from kvwall.engine.layers.mamba import Mamba
from kvwall.engine.layers.mamba2 import Mamba2
from kvwall.engine.layers.mlp import make_mlp
from kvwall.engine.layers.moe import MoE
from kvwall.engine.layers.norm import make_norm
from kvwall.engine.layers.rope import Rotary
from kvwall.errors import KvwallError
from kvwall.spec.model import MLP, Attention as AttentionSpec, LatentAttention as LatentSpec, ModelSpec, MoE as MoESpec
from kvwall.spec.model import Mamba as MambaSpec, Mamba2 as Mamba2Spec

ENGINE_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "gemma2", "phi3",
                   "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3", "mamba", "falcon_mamba", "mamba2",
                   "jamba", "nemotron_h")
MIXERS = (AttentionSpec, LatentSpec, MambaSpec, Mamba2Spec)  # sequence mixers the engine builds


def check_supported(spec: ModelSpec) -> None:
    """One line naming what the engine runs when a spec has something it does not."""
    if spec.model_type not in ENGINE_FAMILIES:
        raise KvwallError(f"the engine does not run model_type {spec.model_type!r} yet; it runs "
                          f"{', '.join(ENGINE_FAMILIES)}")
    for i, layer in enumerate(spec.layers):  # a block has a mixer, a channel mixer or both (Nemotron-H: one)
        mixer_ok = layer.mixer is None or isinstance(layer.mixer, MIXERS)
        ffn_ok = layer.ffn is None or isinstance(layer.ffn, (MLP, MoESpec))
        if not (mixer_ok and ffn_ok) or (layer.mixer is None and layer.ffn is None):
            raise KvwallError(f"layer {i} of {spec.name} is {layer.describe()}; the engine runs attention, MLA, "
                              f"Mamba or Mamba-2 + MLP or MoE layers ({', '.join(ENGINE_FAMILIES)})")


def make_mixer(spec: ModelSpec, index: int) -> nn.Module | None:
    """The layer's sequence mixer, by its spec type (None: a Nemotron-H MLP/MoE block has none)."""
    m = spec.layers[index].mixer
    if m is None:
        return None
    if isinstance(m, LatentSpec):
        return LatentAttention(m, spec.hidden, index)
    if isinstance(m, MambaSpec):
        return Mamba(m, spec.hidden, index)
    if isinstance(m, Mamba2Spec):
        return Mamba2(m, spec.hidden, index, spec.norm_eps)
    return Attention(m, spec.hidden, index, spec.norm_eps, gemma_norm=spec.norm == "rms1p")


def make_ffn(spec: ModelSpec, index: int) -> nn.Module | None:
    """The layer's channel mixer, by its spec type (None: a Mamba block has none)."""
    f = spec.layers[index].ffn
    if f is None:
        return None
    return MoE(f, spec.hidden) if isinstance(f, MoESpec) else make_mlp(f, spec.hidden)


def rope_of(mixer) -> tuple:
    """(Rope, rotated head width) of a sequence mixer; (None, 0) when it has no rotary positions."""
    if isinstance(mixer, AttentionSpec):
        return mixer.rope, mixer.head_dim
    if isinstance(mixer, LatentSpec):
        return mixer.rope, mixer.qk_rope_head_dim
    return None, 0


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        norm = lambda: make_norm(spec.norm, spec.hidden, spec.norm_eps)  # noqa: E731
        self.attn = make_mixer(spec, index)  # the sequence mixer: attention, MLA, Mamba or Mamba-2
        self.mlp = make_ffn(spec, index)
        self.attn_norm = norm() if self.attn is not None else None
        self.ffn_norm = norm() if self.mlp is not None else None
        self.post_attn_norm = norm() if spec.sandwich_norms else None
        self.post_ffn_norm = norm() if spec.sandwich_norms else None

    def forward(self, x, pos, rope, cache):
        if self.attn is not None:  # absent in a Nemotron-H MLP/MoE block
            h = self.attn(self.attn_norm(x), pos, rope, cache)  # (B, T, D)
            if self.post_attn_norm is not None:
                h = self.post_attn_norm(h)
            x = x + h
        if self.mlp is None:  # mixer-only block (Mamba; Nemotron-H's Mamba-2 and attention): norm + mixer only
            return x
        h = self.mlp(self.ffn_norm(x))  # (B, T, D)
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        check_supported(spec)
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embed = nn.Embedding(spec.position_embeddings, spec.hidden) if spec.position_embeddings else None
        self.layers = nn.ModuleList(Block(spec, i) for i in range(spec.n_layers))
        self.norm = make_norm(spec.norm, spec.hidden, spec.norm_eps)
        self.lm_head = None if spec.tied_embeddings else nn.Linear(spec.hidden, spec.vocab, bias=False)
        ropes = [rope_of(l.mixer) for l in spec.layers]
        self.rope_keys = sorted({r for r in ropes if r[0] is not None}, key=str)  # distinct rotary tables
        self.rotary = nn.ModuleList(Rotary(r, d) for r, d in self.rope_keys)
        self.rope_of_layer = [self.rope_keys.index(r) if r[0] is not None else None for r in ropes]

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor | None = None, cache=None,
                last_only: bool = False) -> torch.Tensor:
        """tokens (B, T), pos (B, T) (default 0..T-1) -> logits (B, T, V), or (B, 1, V) at each row's last token."""
        B, T = tokens.shape
        if pos is None:
            pos = torch.arange(T, device=tokens.device).expand(B, T)
        cache = cache if cache is not None else self.no_cache(B)
        cache.step(pos)
        x = self.embed(tokens)  # (B, T, D)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        if self.pos_embed is not None:
            self.check_context(int(pos.max()) + 1)
            x = x + self.pos_embed(pos.clamp(min=0))
        tables = [rot(pos, x.dtype) for rot in self.rotary]
        for i, block in enumerate(self.layers):
            r = self.rope_of_layer[i]
            x = block(x, pos, tables[r] if r is not None else None, cache)  # (B, T, D)
        if last_only:
            last = ((pos >= 0).sum(1) - 1).clamp(min=0)  # (B,) index of each row's last real token
            x = x[torch.arange(B, device=x.device), last][:, None]  # (B, 1, D)
        return self.logits(self.norm(x))

    def no_cache(self, batch: int):
        """What a forward without a cache remembers: nothing (attention over the new tokens, SSMs from zero)."""
        if not has_state(self.spec):
            return NoCache()
        w = self.embed.weight
        return ModelCache(NoCache(), StateCache(self.spec, batch, w.dtype, w.device))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        out = x @ w.T  # (B, T, V)
        cap = self.spec.final_softcap
        return cap * torch.tanh(out / cap) if cap else out

    def check_context(self, length: int) -> None:
        limit = self.spec.position_embeddings or self.spec.max_context
        if limit and length > limit:
            raise KvwallError(f"{length} tokens is past {self.spec.name}'s maximum context of {limit}; "
                              "shorten the prompt or --max-new-tokens")
