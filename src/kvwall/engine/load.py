"""Load a Hugging Face checkpoint (config.json + safetensors) into the engine, by HF tensor names.

Each family maps the engine's parameter names to the HF tensors they come from; the engine
fuses [q; k; v] and [gate; up] into one matrix each, and GPT-2's Conv1D weights are stored
transposed. Single files (model.safetensors) and sharded checkpoints
(model.safetensors.index.json) both load; dtype is float32, bfloat16 or float16.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvwall.engine.mixers import mixer_class
from kvwall.engine.model import Transformer, check_supported
from kvwall.errors import KvwallError, first_line
from kvwall.spec.families import family
from kvwall.spec.formats import NATIVE, engine_weights, split_activations
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import ModelSpec
from kvwall.spec.resolve import read_config_file

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class Source:
    """Where one engine tensor comes from: HF tensors, concatenated along dim 0, optionally transposed. Experts
    stored as one 3-D tensor (gpt-oss, Llama 4: (E, in, out)) give expert `index`'s slice; `interleaved`: the
    slice's rows alternate gate and up (gpt-oss's gate_up_proj[..., ::2] / [..., 1::2]), made [gate; up]."""

    names: tuple[str, ...]
    transpose: bool = False
    index: int | None = None
    interleaved: bool = False


@dataclass(frozen=True)
class Style:
    """How one checkpoint layout spells what other layouts spell alike (the family registry names the layout)."""

    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj already fused
    experts: tuple[str, str, str, str] = ("mlp.", "gate_proj", "up_proj", "down_proj")  # where, gate, up, down


def _llama_layer(spec: ModelSpec, i: int, style: Style) -> dict[str, Source]:
    """One decoder layer: its sequence mixer's tensors, its channel mixer's, the block's norms."""
    hf, me = f"model.layers.{i}.", f"layers.{i}."
    layer = spec.layers[i]
    where = mixer_class(layer.mixer).hf_module  # self_attn. (Qwen3-Next's Gated DeltaNet: linear_attn.)
    out = {**_mixer_names(layer.mixer, hf + where, me + "mixer.", style),
           **FFN_NAMES[layer.ffn.kind](layer.ffn, hf, me + "ffn.", style)}
    out[me + "mixer_norm.weight"] = Source((hf + "input_layernorm.weight",))
    if spec.sandwich_norms:  # Gemma: post_attention_layernorm is the attention output's norm
        out[me + "post_mixer_norm.weight"] = Source((hf + "post_attention_layernorm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "pre_feedforward_layernorm.weight",))
        out[me + "post_ffn_norm.weight"] = Source((hf + "post_feedforward_layernorm.weight",))
    else:
        out[me + "ffn_norm.weight"] = Source((hf + "post_attention_layernorm.weight",))
    return out


def _mlp_names(mlp, hf: str, me: str, style: Style = Style()) -> dict[str, Source]:
    hf = hf + "mlp."
    if style.fused:
        out = {me + "w13.weight": Source((hf + "gate_up_proj.weight",))}
    else:
        out = {me + "w13.weight": Source((hf + "gate_proj.weight", hf + "up_proj.weight"))}
    out[me + "w2.weight"] = Source((hf + "down_proj.weight",))
    if mlp.bias:
        out[me + "w13.bias"] = Source((hf + "gate_proj.bias", hf + "up_proj.bias"))
        out[me + "w2.bias"] = Source((hf + "down_proj.bias",))
    return out


def _moe_names(f, hf: str, me: str, style: Style = Style()) -> dict[str, Source]:
    """Router (+ V3 correction bias), experts one by one ([gate; up] fused, down), DeepSeek's shared experts."""
    where, gate, up, down = style.experts
    hf = hf + where
    out = {me + "router.weight": Source((hf + "gate.weight",))}
    if f.routing.bias:
        out[me + "router.bias"] = Source((hf + "gate.e_score_correction_bias",))
    for e in range(f.n_experts):
        x = f"{hf}experts.{e}."
        out[f"{me}experts.{e}.w13.weight"] = Source((x + gate + ".weight", x + up + ".weight"))
        out[f"{me}experts.{e}.w2.weight"] = Source((x + down + ".weight",))
    if f.n_shared:
        x = hf + ("shared_expert." if f.shared_gate else "shared_experts.")  # Qwen's gated one is singular
        out[me + "shared.w13.weight"] = Source((x + "gate_proj.weight", x + "up_proj.weight"))
        out[me + "shared.w2.weight"] = Source((x + "down_proj.weight",))
    if f.n_shared and f.shared_gate:
        out[me + "shared_gate.weight"] = Source((hf + "shared_expert_gate.weight",))
    return out


def _ends(spec: ModelSpec, embed: str, norm: str) -> dict[str, Source]:
    """The names outside the layers: input embedding, final norm, and the LM head when it is not tied."""
    out = {"embed.weight": Source((embed,)), "norm.weight": Source((norm,))}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = Source(("lm_head.weight",))
    return out


def llama_names(spec: ModelSpec, style: Style = Style()) -> dict[str, Source]:
    out = _ends(spec, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(spec.n_layers):
        out.update(_llama_layer(spec, i, style))
    return out


def gpt2_names(spec: ModelSpec) -> dict[str, Source]:
    out = _ends(spec, "transformer.wte.weight", "transformer.ln_f.weight")
    out["pos_embed.weight"] = Source(("transformer.wpe.weight",))
    out["norm.bias"] = Source(("transformer.ln_f.bias",))
    pairs = [("ln_1", "mixer_norm", False), ("attn.c_attn", "mixer.wqkv", True), ("attn.c_proj", "mixer.wo", True),
             ("ln_2", "ffn_norm", False), ("mlp.c_fc", "ffn.w1", True), ("mlp.c_proj", "ffn.w2", True)]
    for i in range(spec.n_layers):
        for hf, me, conv1d in pairs:
            out[f"layers.{i}.{me}.weight"] = Source((f"transformer.h.{i}.{hf}.weight",), transpose=conv1d)
            out[f"layers.{i}.{me}.bias"] = Source((f"transformer.h.{i}.{hf}.bias",))
    return out


def _mixer_names(m, hf: str, me: str, style: Style = Style()) -> dict[str, Source]:
    """A sequence mixer's tensors, as its engine class names them (kvwall.engine.mixers, by the spec's kind)."""
    names = mixer_class(m).checkpoint_names(m, hf, me, style.fused)
    return {mine: Source(theirs) for mine, theirs in names.items()}


def mamba_names(spec: ModelSpec) -> dict[str, Source]:
    """mamba, falcon_mamba, mamba2: backbone.embeddings, backbone.layers.N.{norm, mixer.*}, backbone.norm_f."""
    out = _ends(spec, "backbone.embeddings.weight", "backbone.norm_f.weight")
    for i, layer in enumerate(spec.layers):
        hf = f"backbone.layers.{i}."
        out[f"layers.{i}.mixer_norm.weight"] = Source((hf + "norm.weight",))
        out.update(_mixer_names(layer.mixer, hf + "mixer.", f"layers.{i}.mixer."))
    return out


def _one_mlp(hf: str, me: str, gated: bool, bias: bool) -> dict[str, Source]:
    """One (expert) MLP saved as gate_proj/up_proj/down_proj (gated: engine w13 = [gate; up], w2) or
    up_proj/down_proj (plain: engine w1, w2)."""
    first = ("gate_proj", "up_proj") if gated else ("up_proj",)
    mine = "w13" if gated else "w1"
    out = {f"{me}{mine}.weight": Source(tuple(f"{hf}{x}.weight" for x in first)),
           f"{me}w2.weight": Source((hf + "down_proj.weight",))}
    if bias:
        out[f"{me}{mine}.bias"] = Source(tuple(f"{hf}{x}.bias" for x in first))
        out[f"{me}w2.bias"] = Source((hf + "down_proj.bias",))
    return out


def _hybrid_ffn(f, hf: str, me: str, router: str) -> dict[str, Source]:
    """A hybrid's channel mixer: a dense MLP, or router (+ correction bias) + experts.E + shared_experts."""
    if f.kind == "mlp":
        return _one_mlp(hf, me, f.gated, f.bias)
    out = {me + "router.weight": Source((hf + router + ".weight",))}
    if f.routing.bias:
        out[me + "router.bias"] = Source((hf + router + ".e_score_correction_bias",))
    for e in range(f.n_experts):
        out.update(_one_mlp(f"{hf}experts.{e}.", f"{me}experts.{e}.", f.gated, False))
    if f.n_shared:
        out.update(_one_mlp(hf + "shared_experts.", me + "shared.", f.gated, False))
    return out


def jamba_names(spec: ModelSpec) -> dict[str, Source]:
    """model.layers.N.{input_layernorm, self_attn.* | mamba.*, pre_ff_layernorm, feed_forward.*}, final_layernorm."""
    out = _ends(spec, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for i, layer in enumerate(spec.layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        where = "self_attn." if layer.mixer.keeps_tokens else "mamba."
        out.update(_mixer_names(layer.mixer, hf + where, me + "mixer."))
        out.update(_hybrid_ffn(layer.ffn, hf + "feed_forward.", me + "ffn.", "router"))
        out[me + "mixer_norm.weight"] = Source((hf + "input_layernorm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "pre_ff_layernorm.weight",))
    return out


def nemotron_h_names(spec: ModelSpec) -> dict[str, Source]:
    """backbone.layers.N.{norm, mixer.*}: the mixer is Mamba-2, attention, an MLP or an MoE; backbone.norm_f."""
    out = _ends(spec, "backbone.embeddings.weight", "backbone.norm_f.weight")
    for i, layer in enumerate(spec.layers):
        hf, me = f"backbone.layers.{i}.", f"layers.{i}."
        if layer.mixer is not None:
            out.update(_mixer_names(layer.mixer, hf + "mixer.", me + "mixer."))
        else:
            out.update(_hybrid_ffn(layer.ffn, hf + "mixer.", me + "ffn.", "gate"))
        norm = "mixer_norm" if layer.mixer is not None else "ffn_norm"  # the block's one norm
        out[f"{me}{norm}.weight"] = Source((hf + "norm.weight",))
    return out


def _fused_experts(f, hf: str, me: str, interleaved: bool) -> dict[str, Source]:
    """Experts stored as one tensor each across experts (gpt-oss, Llama 4): experts.gate_up_proj (E, hidden, 2F)
    and experts.down_proj (E, F, hidden), expert e their slice [e] transposed; gpt-oss: biases
    (gate_up_proj_bias (E, 2F), down_proj_bias (E, hidden)) and a router bias; Llama 4: a shared_expert."""
    out = {me + "router.weight": Source((hf + "router.weight",))}
    if f.bias:
        out[me + "router.logit_bias"] = Source((hf + "router.bias",))
    x = hf + "experts."
    for e in range(f.n_experts):
        out[f"{me}experts.{e}.w13.weight"] = Source((x + "gate_up_proj",), True, e, interleaved)
        out[f"{me}experts.{e}.w2.weight"] = Source((x + "down_proj",), True, e)
        if f.bias:
            out[f"{me}experts.{e}.w13.bias"] = Source((x + "gate_up_proj_bias",), False, e, interleaved)
            out[f"{me}experts.{e}.w2.bias"] = Source((x + "down_proj_bias",), False, e)
    if f.n_shared:
        out.update(_one_mlp(hf + "shared_expert.", me + "shared.", f.gated, False))
    return out


def fused_expert_names(spec: ModelSpec, where: str, interleaved: bool) -> dict[str, Source]:
    """gpt-oss (mlp.) and Llama 4 text (feed_forward.): llama names for attention and norms, the channel mixer a
    dense MLP (gate/up/down_proj) or experts in 3-D tensors (_fused_experts)."""
    out = _ends(spec, "model.embed_tokens.weight", "model.norm.weight")
    for i, layer in enumerate(spec.layers):
        hf, me, f = f"model.layers.{i}.", f"layers.{i}.", layer.ffn
        out.update(_mixer_names(layer.mixer, hf + "self_attn.", me + "mixer."))
        out.update(_fused_experts(f, hf + where, me + "ffn.", interleaved) if f.kind == "moe"
                   else _one_mlp(hf + where, me + "ffn.", f.gated, f.bias))
        out[me + "mixer_norm.weight"] = Source((hf + "input_layernorm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "post_attention_layernorm.weight",))
    return out


LFM2_ATTENTION = {"o_proj.": "out_proj.", "q_norm.": "q_layernorm.", "k_norm.": "k_layernorm."}  # LFM2's spellings


def lfm2_names(spec: ModelSpec) -> dict[str, Source]:
    """LFM2: model.layers.N.{operator_norm, self_attn.* (out_proj, q/k_layernorm) | conv.*, ffn_norm,
    feed_forward.{w1 gate, w3 up, w2 down}}; the final norm is model.embedding_norm (applied after the layers)."""
    out = _ends(spec, "model.embed_tokens.weight", "model.embedding_norm.weight")
    for i, layer in enumerate(spec.layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        where = hf + mixer_class(layer.mixer).hf_module  # self_attn. or conv.
        for mine, src in _mixer_names(layer.mixer, where, me + "mixer.").items():
            theirs = src.names
            for old, new in LFM2_ATTENTION.items():
                theirs = tuple(n.replace(where + old, where + new) for n in theirs)
            out[mine] = Source(theirs)
        ff = hf + "feed_forward."
        out[me + "ffn.w13.weight"] = Source((ff + "w1.weight", ff + "w3.weight"))
        out[me + "ffn.w2.weight"] = Source((ff + "w2.weight",))
        out[me + "mixer_norm.weight"] = Source((hf + "operator_norm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "ffn_norm.weight",))
    return out


def _granite_mlp(hf: str, me: str) -> dict[str, Source]:
    """A Granite MLP: input_linear = [gate; up] (chunked in halves by GraniteMoeHybridMLP), output_linear down."""
    return {me + "w13.weight": Source((hf + "input_linear.weight",)),
            me + "w2.weight": Source((hf + "output_linear.weight",))}


def granite_hybrid_names(spec: ModelSpec) -> dict[str, Source]:
    """granitemoehybrid: model.layers.N.{input_layernorm, mamba.* | self_attn.*, post_attention_layernorm,
    block_sparse_moe.{router.layer, input_linear (E, 2F, hidden), output_linear (E, hidden, F)}, shared_mlp.*}."""
    out = _ends(spec, "model.embed_tokens.weight", "model.norm.weight")
    for i, layer in enumerate(spec.layers):
        hf, me, f = f"model.layers.{i}.", f"layers.{i}.", layer.ffn
        where = "self_attn." if layer.mixer.keeps_tokens else "mamba."
        out.update(_mixer_names(layer.mixer, hf + where, me + "mixer."))
        if f.kind == "moe":  # routed experts and the shared MLP (engine: the MoE's shared expert)
            x = hf + "block_sparse_moe."
            out[me + "ffn.router.weight"] = Source((x + "router.layer.weight",))
            for e in range(f.n_experts):
                out[f"{me}ffn.experts.{e}.w13.weight"] = Source((x + "input_linear.weight",), index=e)
                out[f"{me}ffn.experts.{e}.w2.weight"] = Source((x + "output_linear.weight",), index=e)
            out.update(_granite_mlp(hf + "shared_mlp.", me + "ffn.shared."))
        else:  # num_local_experts 0: the shared MLP alone
            out.update(_granite_mlp(hf + "shared_mlp.", me + "ffn."))
        out[me + "mixer_norm.weight"] = Source((hf + "input_layernorm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "post_attention_layernorm.weight",))
    return out


def falcon_h1_names(spec: ModelSpec) -> dict[str, Source]:
    """Falcon-H1: model.layers.N.{input_layernorm, self_attn.*, mamba.*, pre_ff_layernorm,
    feed_forward.{gate,up,down}_proj}, model.final_layernorm."""
    out = _ends(spec, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for i, layer in enumerate(spec.layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        out.update(_mixer_names(layer.mixer, hf + mixer_class(layer.mixer).hf_module, me + "mixer."))
        out.update(_one_mlp(hf + "feed_forward.", me + "ffn.", layer.ffn.gated, layer.ffn.bias))
        out[me + "mixer_norm.weight"] = Source((hf + "input_layernorm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "pre_ff_layernorm.weight",))
    return out


def kimi_linear_names(spec: ModelSpec) -> dict[str, Source]:
    """Kimi Linear: llama names with the channel mixer under block_sparse_moe.: a MoE as Mixtral saves its experts
    (w1 gate, w3 up, w2 down) with a router correction bias and shared_experts, or a dense MLP's gate/up/down_proj."""
    out = llama_names(spec, Style(experts=("block_sparse_moe.", "w1", "w3", "w2")))
    for i, layer in enumerate(spec.layers):
        if layer.ffn.kind == "mlp":  # llama_names put it under mlp.
            me = f"layers.{i}.ffn."
            out = {k: v for k, v in out.items() if not k.startswith(me)}
            out.update(_one_mlp(f"model.layers.{i}.block_sparse_moe.", me, layer.ffn.gated, layer.ffn.bias))
    return out


# A channel mixer's tensors under a layer's prefix, by the spec's kind.
FFN_NAMES = {"mlp": _mlp_names, "moe": _moe_names}

# The checkpoint layouts the family registry (kvwall.spec.families) names: layout -> the engine's tensor sources.
LAYOUTS: dict[str, Callable[[ModelSpec], dict[str, Source]]] = {
    "llama": llama_names,
    "phi3": lambda spec: llama_names(spec, Style(fused=True)),
    "mixtral": lambda spec: llama_names(spec, Style(experts=("block_sparse_moe.", "w1", "w3", "w2"))),
    "gpt2": gpt2_names, "mamba": mamba_names, "jamba": jamba_names, "nemotron_h": nemotron_h_names,
    "gpt_oss": lambda spec: fused_expert_names(spec, "mlp.", interleaved=True),
    "llama4": lambda spec: fused_expert_names(spec, "feed_forward.", interleaved=False),
    "lfm2": lfm2_names, "granitemoehybrid": granite_hybrid_names, "falcon_h1": falcon_h1_names,
    "kimi_linear": kimi_linear_names}

# Other spellings of the same tensors: bare GPT-2 checkpoints, multimodal Gemma 3 (v5, then v4 names), older Mamba.
PREFIX_ALTERNATIVES = [("transformer.", ""), ("model.", "model.language_model."), ("model.", "language_model.model."),
                       ("lm_head.", "language_model.lm_head."), ("backbone.embeddings.", "backbone.embedding.")]


# Tensors Hugging Face checkpoints of the supported families carry that the engine legitimately leaves unused.
IGNORED = [
    (re.compile(r"(^|\.)rotary_emb\.inv_freq$"), "rotary frequencies: the engine rebuilds them from config.json"),
    (re.compile(r"(^|\.)h\.\d+\.attn\.(masked_)?bias$"), "GPT-2's causal-mask buffers, not weights"),
    (re.compile(r"(^|\.)(vision_tower|vision_model|multi_modal_projector)\."),
     "multimodal Gemma 3's and Llama 4's vision side: the engine runs the text decoder"),
    (re.compile(r"(^|\.)self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$"),
     "MiniMax's lightning-attention decay buffers: the engine computes them from config.json (layers/lightning.py)"),
]
HEADER_LIMIT = 100_000_000  # bytes; safetensors itself refuses larger headers
SHOWN = 5  # names listed in one mismatch message


def _damaged(file: Path, why: str) -> KvwallError:
    return KvwallError(f"{file}: {why}; the file is damaged or not safetensors: re-download or re-save the checkpoint")


def read_header(file: Path) -> dict[str, tuple[int, ...]]:
    """A safetensors file's tensor names and shapes, from its header only; every problem names the file."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            raw = f.read(n) if 0 < n <= min(size - 8, HEADER_LIMIT) else b""
    except OSError as e:
        why = e.strerror or first_line(e)
        raise KvwallError(f"{file}: cannot be read ({why}); check the file and its permissions") from None
    if size < 8:
        raise _damaged(file, "is empty" if size == 0 else f"is only {size} bytes long")
    if n > HEADER_LIMIT or n > size - 8:
        raise _damaged(file, f"its header claims {n:,} bytes, the file has {size:,}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _damaged(file, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _damaged(file, "its header is not a JSON object")
    return _shapes(file, header, size - 8 - n)


def _shapes(file: Path, header: dict, data_bytes: int) -> dict[str, tuple[int, ...]]:
    """name -> shape for each tensor of a parsed header, checking that its bytes lie inside the file."""
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (_, end) = tuple(int(x) for x in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise _damaged(file, f"its header entry for {name!r} has no valid shape and data_offsets") from None
        if not isinstance(end, int) or end > data_bytes:
            raise _damaged(file, f"tensor {name!r} ends past the end of the file (truncated)")
        out[name] = shape
    return out


def _read_index(index: Path) -> dict[str, str]:
    """model.safetensors.index.json -> its weight_map (tensor name -> shard file name)."""
    try:
        raw = json.loads(index.read_bytes())
    except OSError as e:
        raise KvwallError(f"{index}: cannot be read ({e.strerror or first_line(e)}); check the file") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise KvwallError(f"{index} is not valid JSON ({first_line(e)}); re-download the checkpoint's index") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise KvwallError(f"{index} has no weight_map (an object: tensor name -> shard file); "
                          "re-download the checkpoint's index")
    return weight_map


class Checkpoint:
    """The tensors of a safetensors checkpoint directory, single file or sharded, read lazily.

    Opening reads every file's header: a damaged file, a shard the index names but that is missing, or a
    tensor the index puts in a shard that does not hold it are errors here, before any weight is read."""

    def __init__(self, path: Path):
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        self.path = path
        if index.is_file():
            self.weight_map = _read_index(index)
            self.shapes = self._shard_shapes(index)
        elif single.is_file():
            self.shapes = read_header(single)  # name -> shape
            self.weight_map = {k: single.name for k in self.shapes}
        else:
            raise KvwallError(f"{path} has no model.safetensors or model.safetensors.index.json; "
                              "save the model with safetensors (save_pretrained does by default)")
        self.fp4 = self._mxfp4_pairs()

    def _mxfp4_pairs(self) -> dict[str, tuple[str, str]]:
        """MXFP4 tensors (gpt-oss's experts: NAME_blocks + NAME_scales, kvwall.engine.mxfp4) seen as one tensor NAME
        of the dequantized, transposed shape, which get() dequantizes: NAME -> (blocks name, scales name)."""
        from kvwall.engine.mxfp4 import stored_shape

        out = {}
        for blocks in [k for k in self.shapes if k.endswith("_blocks")]:
            name = blocks.removesuffix("_blocks")
            scales = name + "_scales"
            if scales in self.shapes:
                where = f"{self.path}: {name}"
                self.shapes[name] = stored_shape(self.shapes.pop(blocks), self.shapes.pop(scales), where)
                self.weight_map[name] = self.weight_map[blocks]  # where the blocks are; the scales keep theirs
                out[name] = (blocks, scales)
        return out

    def _shard_shapes(self, index: Path) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape from the shards' headers; each tensor must be in the shard the index says."""
        shapes: dict[str, tuple[int, ...]] = {}
        for shard in sorted(set(self.weight_map.values())):
            file = self.path / shard
            if Path(shard).name != shard or not file.is_file():
                raise KvwallError(f"{index} names shard {shard!r}, which is not in {self.path}; "
                                  "download every shard of the checkpoint")
            held = read_header(file)
            wrong = [k for k, v in self.weight_map.items() if v == shard and k not in held]
            if wrong:
                raise KvwallError(f"{index} puts tensor {wrong[0]!r} in {shard}, which does not contain it; "
                                  "the index does not match the shards: re-download them together")
            shapes.update({k: held[k] for k, v in self.weight_map.items() if v == shard})
        return shapes

    def mismatch(self, problems: str) -> KvwallError:
        """check_names' error: the weights against the config they came with."""
        return KvwallError(f"{self.path}: the weights do not match config.json: {problems}; "
                           "is config.json the one saved with these weights?")

    def shown(self, name: str) -> str:
        """A tensor's name as the checkpoint spells it, for messages."""
        return name

    def find(self, name: str) -> str | None:
        if name in self.weight_map:
            return name
        for old, new in PREFIX_ALTERNATIVES:
            if name.startswith(old) and new + name[len(old):] in self.weight_map:
                return new + name[len(old):]
        return None

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        found = self.find(name)
        if found is None:
            raise KvwallError(f"{self.path}: tensor {name!r} is missing from the checkpoint; "
                              "is the checkpoint complete and of the config's model_type?")
        if found in self.fp4:  # MXFP4 blocks + scales: dequantized here, float32
            from kvwall.engine.mxfp4 import dequantize

            return dequantize(*(self._raw(n) for n in self.fp4[found]))
        file = self.path / self.weight_map[found]
        try:
            with safe_open(file, "pt") as f:
                t = f.get_tensor(found)
        except Exception as e:  # safetensors' own error types vary by version; any failure here is the file's
            raise _damaged(file, f"tensor {found!r} cannot be read ({first_line(e)})") from None
        if not t.is_floating_point():
            raise KvwallError(f"{file}: tensor {found!r} is stored as {t.dtype}, not floating point; "
                              "the engine loads float32, bfloat16 or float16 weights")
        return t


    def _raw(self, name: str) -> torch.Tensor:
        """A stored tensor as it is (MXFP4's uint8 blocks and scales)."""
        from safetensors import safe_open

        file = self.path / self.weight_map[name]
        try:
            with safe_open(file, "pt") as f:
                return f.get_tensor(name)
        except Exception as e:  # as in get(): any failure here is the file's
            raise _damaged(file, f"tensor {name!r} cannot be read ({first_line(e)})") from None


def _assemble(ckpt: Checkpoint, src: Source) -> torch.Tensor:
    """The engine tensor from its (already shape-checked) parts: transposed, then joined along dim 0."""
    parts = [ckpt.get(n) for n in src.names]
    parts = [p if src.index is None else p[src.index] for p in parts]  # one expert of a 3-D tensor
    parts = [p.T if src.transpose else p for p in parts]
    parts = [torch.cat([p[0::2], p[1::2]], 0) if src.interleaved else p for p in parts]  # (2F, ...): [gate; up]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def load_model(path: str | Path, dtype: str | torch.dtype = torch.float32, device: str = "cpu",
               weights: str | None = None) -> Transformer:
    """config.json + safetensors in `path` (or a .gguf file) -> an engine Transformer in eval mode.

    weights (`--weights`, kvwall.spec.formats.engine_weights): fp32 / bf16 / fp16 set the dtype; int8 / int4 /
    q4_0 / q4_1 / q8_0 quantize every projection into a PackedLinear after load (activations stay in dtype);
    native keeps a .gguf's own Q4_0 / Q4_1 / Q8_0 blocks (no rounding at all); a +a8 suffix rounds the packed
    projections' inputs to int8 per group (Transformer.set_activations)."""
    model = _load_model(Path(path).expanduser(), dtype, device, weights)
    activations = split_activations(weights)[1] if weights is not None else "fp32"
    return model.set_activations(activations) if activations != "fp32" else model


def _load_model(path: Path, dtype, device: str, weights: str | None) -> Transformer:
    if weights is not None:
        weights = split_activations(weights)[0]
        fmt = engine_weights(weights)
        if fmt is None and path.suffix.lower() != ".gguf":
            raise KvwallError(f"--weights {NATIVE} keeps a .gguf file's own quantized blocks; {path} is not a .gguf: "
                              "pass int8 or int4 to quantize it")
        if fmt is not None and fmt.is_float():
            dtype, weights = fmt.torch_dtype, None
        else:
            weights = fmt or NATIVE
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise KvwallError(f"dtype {dtype} is not one the engine loads (float32, bfloat16, float16)")
    if path.suffix.lower() == ".gguf":  # llama.cpp's single-file format: its own loader, same name maps
        from kvwall.engine.gguf import load_gguf

        return load_gguf(path, dtype, device, weights)
    if not (path / "config.json").is_file():
        raise KvwallError(f"{path} is not a checkpoint directory (no config.json)")
    spec = spec_from_config(read_config_file(path / "config.json"), name=path.name, where=str(path / "config.json"))
    check_supported(spec)
    ckpt = Checkpoint(path)  # reads the headers first: a damaged file fails before the model is built
    return build_loaded(saved_head(spec, ckpt), ckpt, dtype, device, weights)


def saved_head(spec: ModelSpec, ckpt: Checkpoint) -> ModelSpec:
    """The spec with an untied LM head when config.json ties it but the checkpoint holds an lm_head.weight that
    is not the embedding: transformers 5.25 then loads that tensor as the head and does not tie (it warns)."""
    head = ckpt.find("lm_head.weight")
    if not spec.tied_embeddings or head is None:
        return spec
    embed = ckpt.find(LAYOUTS[family(spec.model_type).layout](spec)["embed.weight"].names[0])
    if embed is None or torch.equal(ckpt.get(head), ckpt.get(embed)):
        return spec  # a missing table is check_names' to report; an equal copy is the tie itself
    return replace(spec, tied_embeddings=False)


def check_checkpoint(spec: ModelSpec, ckpt) -> None:
    """The checkpoint's tensor names and shapes against the model `spec` describes (check_names, which loading
    runs), without reading a weight: the model is built on the meta device."""
    with torch.device("meta"):
        model = Transformer(spec)
    check_names(ckpt, LAYOUTS[family(spec.model_type).layout](spec), model)


def build_loaded(spec: ModelSpec, ckpt, dtype: torch.dtype, device: str, weights=None) -> Transformer:
    """The model of `spec` built empty (meta), filled from a checkpoint (safetensors or GGUF: find, get,
    weight_map, shapes), in eval mode on `device`; projections packed when `weights` is a packed Format or
    NATIVE (load_model)."""
    with torch.device("meta"):
        model = Transformer(spec)
    state = load_state(ckpt, model, dtype)
    model.load_state_dict(state, assign=True)  # rotary tables are non-persistent buffers, built on the CPU
    assert not any(p.is_meta for p in model.parameters()), "every parameter comes from the checkpoint"
    if weights is not None:
        _pack(model, ckpt, weights)
    return model.to(device).eval().prepack()  # loaded weights in the fast path's layout (oneDNN's where it runs)


def _pack(model: Transformer, ckpt, weights) -> None:
    """Projections into PackedLinear: quantized to a Format, or (NATIVE) the .gguf's own blocks where every part
    of the engine matrix (q, k, v; gate, up) is stored in the same Q4_0 / Q4_1 / Q8_0 type, and the embedding
    table and LM head likewise."""
    from kvwall.engine.layers.packed import pack_head, pack_model

    if weights != NATIVE:
        pack_model(model, weights)
        return
    names = LAYOUTS[family(model.spec.model_type).layout](model.spec)

    def source(module: str, lin):
        src = names[module + ".weight"]
        parts = [ckpt.packed(ckpt.find(n)) for n in src.names]
        if src.transpose or any(p is None for p in parts) or len({p[3] for p in parts}) != 1:
            return None
        cat = lambda i: None if parts[0][i] is None else torch.cat([p[i] for p in parts])  # noqa: E731
        return cat(0), cat(1), cat(2), parts[0][3]

    if not hasattr(ckpt, "packed"):
        raise KvwallError(f"--weights {NATIVE} needs a .gguf file")
    pack_model(model, source=source)
    table, head = (source(n, None) if n + ".weight" in names else None for n in ("embed", "lm_head"))
    pack_head(model, table=table, head=head)  # SmolLM2's Q8_0 token table, also its tied head


def load_state(ckpt: Checkpoint, model: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every engine parameter from the checkpoint, shape-checked, converted to dtype, checked finite."""
    names = LAYOUTS[family(model.spec.model_type).layout](model.spec)
    expected = dict(model.named_parameters())
    assert set(names) == set(expected), sorted(set(names) ^ set(expected))
    check_names(ckpt, names, model)
    state = {}
    for me, src in names.items():
        state[me] = _finite(ckpt, src, _assemble(ckpt, src).to(dtype).contiguous())
    return state


def _finite(ckpt: Checkpoint, src: Source, t: torch.Tensor) -> torch.Tensor:
    """t unchanged when every value is finite; else an error naming the first part that is not."""
    if torch.isfinite(t).all():
        return t
    for name in src.names:
        if not torch.isfinite(ckpt.get(name)).all():
            raise KvwallError(f"{ckpt.path}: tensor {ckpt.find(name)!r} holds NaN or inf values; "
                              "the weights are damaged: re-download or re-save the checkpoint")
    raise KvwallError(f"{ckpt.path}: tensor {' + '.join(src.names)} has values too large for {t.dtype} "
                      "(they become inf); load it in float32 or bfloat16")


def check_names(ckpt: Checkpoint, names: dict[str, Source], model: Transformer) -> None:
    """The checkpoint against the config, before any weight is read: tensors missing, tensors no Source uses
    (not IGNORED), wrongly shaped tensors (each q/k/v or gate/up part on its own). One error lists them all."""
    missing = [ckpt.shown(n) for src in names.values() for n in src.names if ckpt.find(n) is None]
    used = {ckpt.find(n) for src in names.values() for n in src.names}
    used |= {part for n in list(used) for part in getattr(ckpt, "fp4", {}).get(n, ())}  # MXFP4 blocks + scales
    unexpected = [ckpt.shown(k) for k in ckpt.weight_map if k not in used and not _ignored(k, model.spec)]
    shapes = [p for me, src in names.items() for p in _shape_problems(ckpt, src, model, me)]
    problems = [f"{_listed(missing)} missing from the checkpoint" if missing else "",
                f"{_listed(unexpected)} in the checkpoint but not used by the model the config describes"
                if unexpected else "", _listed(shapes, quote=False) if shapes else ""]
    if any(problems):
        raise ckpt.mismatch("; ".join(filter(None, problems)))


def _ignored(name: str, spec: ModelSpec) -> bool:
    """A tensor the engine legitimately leaves unused (IGNORED), or a saved copy of a tied LM head."""
    if spec.tied_embeddings and name.endswith("lm_head.weight"):
        return True  # a tied head is the embedding; some checkpoints save the copy anyway
    return any(pattern.search(name) for pattern, _ in IGNORED)


def _listed(items: list[str], quote: bool = True) -> str:
    """The first SHOWN items, and how many more."""
    shown = ", ".join(repr(x) if quote else x for x in items[:SHOWN])
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    noun = ("tensor " if len(items) == 1 else f"{len(items)} tensors ") if quote else ""
    return f"{noun}{shown}{more}"


def _shape_problems(ckpt: Checkpoint, src: Source, model: Transformer, me: str) -> list[str]:
    """How a Source's stored parts differ from the shapes the config implies, checked part by part;
    when every part is off, the joined tensor is named (the config's size differs, not the split)."""
    found = [ckpt.find(n) for n in src.names]
    if None in found:
        return []  # reported as missing
    want = _part_shapes(model, me, len(found), src.transpose)
    have = [ckpt.shapes[n] for n in found]
    if src.index is not None:  # one expert's slice: (E, ...) must hold it
        if any(not h or h[0] <= src.index for h in have):
            return [f"{ckpt.shown(n)} has shape {h}, the config implies experts 0..{src.index} at least"
                    for n, h in zip(found, have) if not h or h[0] <= src.index]
        have = [h[1:] for h in have]
    found = [ckpt.shown(n) for n in found]
    wrong = [f"{n} has shape {h}, the config implies {w}" for n, h, w in zip(found, have, want) if h != w]
    joined, implied = _joined(have, src.transpose), str(tuple(model.get_parameter(me).shape))
    if len(wrong) < 2 or len(wrong) < len(found) or joined == implied:
        return wrong  # some parts right, or the sizes add up: the split is off
    return [f"{' + '.join(found)} has shape {joined}, the config implies {implied}"]


def _part_shapes(model: Transformer, me: str, n: int, transpose: bool) -> list[tuple[int, ...]]:
    """The stored shape of each of the n parts the engine tensor `me` is joined from (along dim 0, after
    the transpose): attention's [q; k; v] by its sizes, [gate; up] in halves."""
    shape = tuple(model.get_parameter(me).shape)
    owner = model.get_submodule(me.rsplit(".", 2)[0])  # the module holding the fused Linear
    sizes = getattr(owner, "sizes", None)
    rows = list(sizes) if n > 1 and sizes is not None and len(sizes) == n else [shape[0] // n] * n
    parts = [(r, *shape[1:]) for r in rows]
    return [p[::-1] if transpose else p for p in parts]


def _joined(shapes: list[tuple[int, ...]], transpose: bool) -> str:
    """The shape the parts would have joined (along dim 0 after the transpose), or each part's shape."""
    shapes = [s[::-1] if transpose else s for s in shapes]
    if all(len(s) == len(shapes[0]) and s[1:] == shapes[0][1:] for s in shapes):
        return str((sum(s[0] for s in shapes), *shapes[0][1:]))
    return " and ".join(map(str, shapes))
