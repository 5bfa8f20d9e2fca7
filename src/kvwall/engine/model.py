"""A decoder-only transformer built from a ModelSpec (gpt-fast style: the whole model in one sitting).

    tokens (B, T), pos (B, T) -> embed (* embed_scale) (+ learned positions)
      -> for each layer: x += [post_norm](mixer(norm(x)));  x += [post_norm](ffn(norm(x)))   (either may be absent)
      -> final norm -> lm_head (tied to the embedding or not) -> [softcap] -> logits (B, T, V)

``mixer`` is the layer's sequence mixer (attention, MLA, Mamba or Mamba-2; built by kvwall.engine.mixers)
and ``ffn`` its channel mixer (MLP or MoE); Mamba blocks have no ``ffn``, and Nemotron-H blocks have
one or the other (mixer-only or MLP/MoE-only, one norm each).
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
from kvwall.engine.decode_stack import DecodeStack
from kvwall.engine.layers.attention import Attention
from kvwall.engine.layers.mlp import GatedMLP, PlainMLP
from kvwall.engine.layers.norm import add_norm, make_norm
from kvwall.engine.layers.onednn import OneDnnLinear, available as onednn_available
from kvwall.engine.layers.rope import Rotary
from kvwall.engine.mixers import make_ffn, make_mixer, rotary, runs
from kvwall.errors import KvwallError
from kvwall.spec.families import engine_families, family
from kvwall.spec.model import ModelSpec

ENGINE_FAMILIES = tuple(engine_families())  # derived from the family registry (kvwall.spec.families)


def check_supported(spec: ModelSpec) -> None:
    """One line naming what the engine runs when a spec has something it does not."""
    fam = family(spec.model_type)
    if fam is None or not fam.runs_in_engine:
        why = f" ({fam.why_not})" if fam else ""
        raise KvwallError(f"the engine does not run model_type {spec.model_type!r} yet{why}; it runs "
                          f"{', '.join(ENGINE_FAMILIES)}")
    for i, layer in enumerate(spec.layers):  # a block has a mixer, a channel mixer or both (Nemotron-H: one)
        if not runs(spec, i):
            raise KvwallError(f"layer {i} of {spec.name} is {layer.describe()}; the engine runs "
                              "attention / latent / mamba / mamba2 / gated_deltanet + mlp / moe layers")


def projection_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every attention and MLP projection (nn.Linear, or OneDnnLinear once
    prepacked) and of an LM head of its own (a tied one shares the embedding's rows and stays): the matrices the
    fast path holds in another layout (column-major, or oneDNN's after Transformer.prepack)."""
    kinds = (nn.Linear, OneDnnLinear)
    head = [(model, "lm_head", model.lm_head)] if isinstance(getattr(model, "lm_head", None), kinds) else []
    return [(m, name, lin) for m in model.modules() if isinstance(m, (Attention, GatedMLP, PlainMLP))
            for name, lin in m.named_children() if isinstance(lin, kinds)] + head


def projections(model: nn.Module) -> list[nn.Module]:
    """The projections of projection_slots: 32,000 x 768 read at 16.1 GB/s row-major and 24.2 GB/s column-major
    here, 2 ms of a 27 ms bench decode step."""
    return [lin for _, _, lin in projection_slots(model)]


def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same (out, in) matrix stored transposed: F.linear then multiplies by a row-major (in, out)
    operand, which torch's CPU matmul (MKL) reads from memory faster at batch > 1 (the matmuls of SmolLM2's
    30 layers at batch 16, weights read from DRAM, side by side here: 1.1-1.6x) and about as fast at batch 1."""
    return w if w.device.type != "cpu" or w.dim() != 2 else w.t().contiguous().t()


def fast_projection(lin: nn.Linear, onednn: bool) -> nn.Module:
    """`lin` in the fast path's layout: oneDNN's (OneDnnLinear) when asked and this CPU runs it for the weight's
    dtype, else the same nn.Linear with its weight column-major."""
    w = lin.weight
    if onednn and w.device.type == "cpu" and onednn_available(w.dtype):
        return OneDnnLinear.from_linear(lin)
    lin.weight.data = column_major(w.data)
    return lin


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        norm = lambda: make_norm(spec.norm, spec.hidden, spec.norm_eps)  # noqa: E731
        self.mixer = make_mixer(spec, index)  # the sequence mixer: attention, MLA, Mamba or Mamba-2
        self.ffn = make_ffn(spec, index)  # the channel mixer: MLP or MoE
        self.mixer_norm = norm() if self.mixer is not None else None
        self.ffn_norm = norm() if self.ffn is not None else None
        self.post_mixer_norm = norm() if spec.sandwich_norms else None
        self.post_ffn_norm = norm() if spec.sandwich_norms else None
        self.residual_scale = spec.residual_scale  # Granite: each branch joins the residual times this
        self.alpha_beta = spec.layers[index].alpha_beta  # MiniMax: x = α·norm(x) + β·branch (Layer.alpha_beta)

    def forward(self, x, pos, rope, cache):
        if self.alpha_beta is not None:
            return self.post_norm_residual(x, pos, rope, cache)
        if self.mixer is None:  # a Nemotron-H MLP/MoE block: norm + channel mixer only
            return self.channel(x, self.ffn_norm(x))
        h = self.mixer(self.mixer_norm(x), pos, rope, cache)  # (B, T, D)
        if self.post_mixer_norm is not None:
            h = self.post_mixer_norm(h)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale  # (B, T, D)
        if self.ffn is None:  # mixer-only block (Mamba; Nemotron-H's Mamba-2 and attention): norm + mixer only
            return x + h
        return self.channel(*add_norm(self.ffn_norm, x, h))  # x + h and its norm in one pass

    def post_norm_residual(self, x, pos, rope, cache):
        """MiniMax's block: the normed input is the residual, each side scaled (transformers' MiniMaxDecoderLayer)."""
        a1, b1, a2, b2 = self.alpha_beta
        n = self.mixer_norm(x)  # (B, T, D)
        x = n * a1 + self.mixer(n, pos, rope, cache) * b1  # (B, T, D)
        n = self.ffn_norm(x)  # (B, T, D)
        return n * a2 + self.ffn(n) * b2  # (B, T, D)

    def channel(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """x + [post_norm](ffn(n)), n the normed x."""
        h = self.ffn(n)  # (B, T, D)
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale  # (B, T, D)
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
        ropes = [rotary(layer.mixer) for layer in spec.layers]
        self.rope_keys = sorted({r for r in ropes if r[0] is not None}, key=str)  # distinct rotary tables
        self.rotary = nn.ModuleList(Rotary(r, d) for r, d in self.rope_keys)
        self.rope_of_layer = [self.rope_keys.index(r) if r[0] is not None else None for r in ropes]
        self.onednn = False  # prepack(): projections in oneDNN's layout in the fast path
        self.head_copy = None  # prepack(): a tied head's second copy in oneDNN's layout (set_eager)
        self.eager = False  # set_eager(): the reference path, layer by layer
        self.stack = None  # the fused decode step (engine/decode_stack.py): built at the first, False if none
        # a table loaded into a fast model: its oneDNN copy must follow (projections repack in their own load)
        self.register_load_state_dict_post_hook(Transformer._refresh_head_copy)
        self.set_eager(False)  # the fast path by default; a loader that assigns new weights calls it again

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor | None = None, cache=None,
                last_only: bool = False) -> torch.Tensor:
        """tokens (B, T), pos (B, T) (default 0..T-1) -> logits (B, T, V), or (B, 1, V) at each row's last token."""
        B, T = tokens.shape
        # a new tensor object per pass even when the caller reuses one: the cache's masks live for one pass
        pos = torch.arange(T, device=tokens.device).expand(B, T) if pos is None else pos.view(B, T)
        cache = cache if cache is not None else self.no_cache(B)
        cache.step(pos)
        x = self.embed(tokens)  # (B, T, D)
        if self.spec.embed_scale != 1.0:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        if self.pos_embed is not None:
            self.check_context(int(pos.max()) + 1)
            x = x + self.pos_embed(pos.clamp(min=0))
        tables = [rot(pos, x.dtype) for rot in self.rotary]
        stacked = self.decode_stack(x, tables, cache) if T == 1 else None
        if stacked is not None:
            x = stacked  # every layer in one call
        else:
            for i, block in enumerate(self.layers):
                r = self.rope_of_layer[i]
                x = block(x, pos, tables[r] if r is not None else None, cache)  # (B, T, D)
        if last_only:
            last = ((pos >= 0).sum(1) - 1).clamp(min=0)  # (B,) index of each row's last real token
            x = x[torch.arange(B, device=x.device), last][:, None]  # (B, 1, D)
        return self.logits(self.norm(x))

    def decode_stack(self, x: torch.Tensor, tables: list, cache) -> torch.Tensor | None:
        """x (B, 1, D) after every layer in one C++ call (engine/decode_stack.py), or None where that does not run."""
        if self.eager:
            return None
        if self.stack is None:  # built once per weight layout: set_eager, a load or packing clear it (forget_stack)
            self.stack = DecodeStack.build(self) or False
        return self.stack(x, tables, cache) if self.stack else None

    def forget_stack(self) -> None:
        """Weights or modules changed: the fused decode step is built again at the next step."""
        self.stack = None

    def set_activations(self, activations: str = "fp32") -> Transformer:
        """"int8": every packed projection rounds its input to int8 per weight group first (layers/packed.py
        round_x8), as llama.cpp does for its integer dot products: approximate, and on a CPU with AVX-512 VNNI
        the matmuls run on integer instructions at every number of rows, over a second copy of the codes in the
        kernel's layout (PackedLinear.x8_tiles: the packed weights' bytes again, while on). "fp32": exact (the
        default)."""
        from kvwall.engine.layers.packed import PackedLinear

        if activations not in ("fp32", "int8"):
            raise KvwallError(f"activations {activations!r}: pick fp32 or int8")
        for m in self.modules():
            if isinstance(m, PackedLinear):
                m.x8 = activations == "int8"
        self.forget_stack()
        return self

    def set_eager(self, eager: bool = True) -> Transformer:
        """eager: the reference path (every layer's plain ops, weights in their checkpoint layout), which the
        fast path is tested against; False: the fast path (fused norm, one rotation for q and k, projection
        weights column-major on the CPU (column_major), or in oneDNN's layout after prepack)."""
        for m in self.modules():
            if hasattr(m, "eager"):
                m.eager = eager
        for parent, name, lin in projection_slots(self):
            lin = lin.linear() if isinstance(lin, OneDnnLinear) else lin
            if eager:
                lin.weight.data = lin.weight.data.contiguous()
            setattr(parent, name, lin if eager else fast_projection(lin, self.onednn))
        self._copy_head(not eager and self.onednn)
        self.forget_stack()
        return self

    def _copy_head(self, wanted: bool) -> None:
        """head_copy: a tied head's token table in oneDNN's layout when `wanted` and it runs there, else None.
        The vocabulary head is the largest matrix (SmolLM2-135M: 49,152 x 576, 113 MB of its 538 MB in fp32),
        but a tied one is also the token table, which lookups must read row by row, so its oneDNN copy is held
        besides: +113 MB there for 85 -> 107 tok/s at batch 16 (the head at 16 rows 7.9 against 30.0 ms)."""
        w = getattr(self.embed, "weight", None)  # a float table (a packed one has its own packed head)
        tied = (wanted and self.lm_head is None and isinstance(self.embed, nn.Embedding)
                and w.device.type == "cpu" and onednn_available(w.dtype))
        self.head_copy = OneDnnLinear(w, None, shadow=True) if tied else None

    def _refresh_head_copy(self, _incompatible) -> None:
        self._copy_head(self.head_copy is not None)
        self.forget_stack()

    def prepack(self, onednn: bool = True) -> Transformer:
        """The fast path's projections in oneDNN's layout (engine/layers/onednn.py) where this CPU has it for
        the weights' dtype (else column-major); onednn=False: back to column-major. For a model whose weights
        are loaded: set_eager(True) (the reference) swaps them back to nn.Linear, set_eager(False) repacks."""
        self.onednn = onednn
        return self.set_eager(False)

    def no_cache(self, batch: int):
        """What a forward without a cache remembers: nothing (attention over the new tokens, SSMs from zero)."""
        if not has_state(self.spec):
            return NoCache()
        packed = getattr(self.embed, "head", None)  # a packed table (PackedEmbedding) has no float weight to ask
        dtype, device = ((self.embed.dtype, packed.q.device) if packed is not None
                         else (self.embed.weight.dtype, self.embed.weight.device))
        return ModelCache(NoCache(), StateCache(self.spec, batch, dtype, device))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        head = self.embed if self.lm_head is None else self.lm_head
        head = self.head_copy if self.head_copy is not None else head
        head = getattr(head, "head", head)  # a packed table's tied head (engine/layers/packed.py PackedEmbedding)
        out = x @ head.weight.T if isinstance(head, (nn.Embedding, nn.Linear)) else head(x)  # (B, T, V)
        if self.spec.logit_scale != 1.0:
            out = out * self.spec.logit_scale  # (B, T, V): Granite's 1 / logits_scaling, Falcon-H1's lm_head_multiplier
        cap = self.spec.final_softcap
        return cap * torch.tanh(out / cap) if cap else out

    def check_context(self, length: int) -> None:
        self.spec.check_context(length)
