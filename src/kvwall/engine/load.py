"""Load a Hugging Face checkpoint (config.json + safetensors) into the engine, by HF tensor names.

Each family maps the engine's parameter names to the HF tensors they come from; the engine
fuses [q; k; v] and [gate; up] into one matrix each, and GPT-2's Conv1D weights are stored
transposed. Single files (model.safetensors) and sharded checkpoints
(model.safetensors.index.json) both load; dtype is float32, bfloat16 or float16.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvwall.engine.model import ENGINE_FAMILIES, Transformer, check_supported
from kvwall.errors import KvwallError
from kvwall.spec.model import MLP, LatentAttention, Mamba, Mamba2, ModelSpec, MoE
from kvwall.spec.hf import spec_from_config
from kvwall.spec.resolve import read_config_file

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class Source:
    """Where one engine tensor comes from: HF tensors, concatenated along dim 0, optionally transposed."""

    names: tuple[str, ...]
    transpose: bool = False


def _llama_layer(spec: ModelSpec, i: int) -> dict[str, Source]:
    """One decoder layer: its sequence mixer's tensors, its channel mixer's, the block's norms."""
    hf, me = f"model.layers.{i}.", f"layers.{i}."
    layer = spec.layers[i]
    mixer = _latent_names if isinstance(layer.mixer, LatentAttention) else _attention_names
    ffn = _moe_names if isinstance(layer.ffn, MoE) else _mlp_names
    out = {**mixer(spec, i, hf + "self_attn.", me + "attn."), **ffn(spec, i, hf, me + "mlp.")}
    out[me + "attn_norm.weight"] = Source((hf + "input_layernorm.weight",))
    if spec.sandwich_norms:  # Gemma: post_attention_layernorm is the attention output's norm
        out[me + "post_attn_norm.weight"] = Source((hf + "post_attention_layernorm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "pre_feedforward_layernorm.weight",))
        out[me + "post_ffn_norm.weight"] = Source((hf + "post_feedforward_layernorm.weight",))
    else:
        out[me + "ffn_norm.weight"] = Source((hf + "post_attention_layernorm.weight",))
    return out


def _attention_names(spec: ModelSpec, i: int, hf: str, me: str) -> dict[str, Source]:
    attn = spec.layers[i].mixer
    if spec.model_type == "phi3":  # already fused
        out = {me + "wqkv.weight": Source((hf + "qkv_proj.weight",))}
    else:
        out = {me + "wqkv.weight": Source(tuple(hf + f"{x}_proj.weight" for x in "qkv"))}
    if attn.qkv_bias:
        out[me + "wqkv.bias"] = Source(tuple(hf + f"{x}_proj.bias" for x in "qkv"))
    out[me + "wo.weight"] = Source((hf + "o_proj.weight",))
    if attn.o_bias:
        out[me + "wo.bias"] = Source((hf + "o_proj.bias",))
    if attn.qk_norm:
        out[me + "q_norm.weight"] = Source((hf + "q_norm.weight",))
        out[me + "k_norm.weight"] = Source((hf + "k_norm.weight",))
    return out


def _mlp_names(spec: ModelSpec, i: int, hf: str, me: str) -> dict[str, Source]:
    mlp, hf = spec.layers[i].ffn, hf + "mlp."
    if spec.model_type == "phi3":  # already fused
        out = {me + "w13.weight": Source((hf + "gate_up_proj.weight",))}
    else:
        out = {me + "w13.weight": Source((hf + "gate_proj.weight", hf + "up_proj.weight"))}
    out[me + "w2.weight"] = Source((hf + "down_proj.weight",))
    if mlp.bias:
        out[me + "w13.bias"] = Source((hf + "gate_proj.bias", hf + "up_proj.bias"))
        out[me + "w2.bias"] = Source((hf + "down_proj.bias",))
    return out


def _latent_names(spec: ModelSpec, i: int, hf: str, me: str) -> dict[str, Source]:
    """MLA (DeepSeek-V2/V3 self_attn): q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a, kv_a_layernorm, kv_b, o."""
    m = spec.layers[i].mixer
    q_lora = [("q_a_proj", "wq_a"), ("q_a_layernorm", "q_norm"), ("q_b_proj", "wq_b")]
    pairs = (q_lora if m.q_lora_rank else [("q_proj", "wq")]) + [
        ("kv_a_proj_with_mqa", "wkv_a"), ("kv_a_layernorm", "kv_norm"), ("kv_b_proj", "wkv_b"), ("o_proj", "wo")]
    out = {f"{me}{mine}.weight": Source((f"{hf}{theirs}.weight",)) for theirs, mine in pairs}
    if m.bias:
        biased = [("kv_a_proj_with_mqa", "wkv_a"), ("o_proj", "wo")] + ([("q_a_proj", "wq_a")] if m.q_lora_rank else [])
        out.update({f"{me}{mine}.bias": Source((f"{hf}{theirs}.bias",)) for theirs, mine in biased})
    return out


def _moe_names(spec: ModelSpec, i: int, hf: str, me: str) -> dict[str, Source]:
    """Router (+ V3 correction bias), experts one by one ([gate; up] fused, down), DeepSeek's shared experts."""
    f = spec.layers[i].ffn
    if spec.model_type == "mixtral":  # block_sparse_moe.experts.N.{w1: gate, w3: up, w2: down}
        hf, (gate, up, down) = hf + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        hf, (gate, up, down) = hf + "mlp.", ("gate_proj", "up_proj", "down_proj")
    out = {me + "router.weight": Source((hf + "gate.weight",))}
    if f.routing.bias:
        out[me + "router.bias"] = Source((hf + "gate.e_score_correction_bias",))
    for e in range(f.n_experts):
        x = f"{hf}experts.{e}."
        out[f"{me}experts.{e}.w13.weight"] = Source((x + gate + ".weight", x + up + ".weight"))
        out[f"{me}experts.{e}.w2.weight"] = Source((x + down + ".weight",))
    if f.n_shared:
        x = hf + "shared_experts."
        out[me + "shared.w13.weight"] = Source((x + "gate_proj.weight", x + "up_proj.weight"))
        out[me + "shared.w2.weight"] = Source((x + "down_proj.weight",))
    return out


def _ends(spec: ModelSpec, embed: str, norm: str) -> dict[str, Source]:
    """The names outside the layers: input embedding, final norm, and the LM head when it is not tied."""
    out = {"embed.weight": Source((embed,)), "norm.weight": Source((norm,))}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = Source(("lm_head.weight",))
    return out


def llama_names(spec: ModelSpec) -> dict[str, Source]:
    out = _ends(spec, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(spec.n_layers):
        out.update(_llama_layer(spec, i))
    return out


def gpt2_names(spec: ModelSpec) -> dict[str, Source]:
    out = _ends(spec, "transformer.wte.weight", "transformer.ln_f.weight")
    out["pos_embed.weight"] = Source(("transformer.wpe.weight",))
    out["norm.bias"] = Source(("transformer.ln_f.bias",))
    pairs = [("ln_1", "attn_norm", False), ("attn.c_attn", "attn.wqkv", True), ("attn.c_proj", "attn.wo", True),
             ("ln_2", "ffn_norm", False), ("mlp.c_fc", "mlp.w1", True), ("mlp.c_proj", "mlp.w2", True)]
    for i in range(spec.n_layers):
        for hf, me, conv1d in pairs:
            out[f"layers.{i}.{me}.weight"] = Source((f"transformer.h.{i}.{hf}.weight",), transpose=conv1d)
            out[f"layers.{i}.{me}.bias"] = Source((f"transformer.h.{i}.{hf}.bias",))
    return out


def ssm_mixer_names(m: Mamba | Mamba2, hf: str, me: str) -> dict[str, Source]:
    """A Mamba or Mamba-2 mixer's tensors: the engine keeps Hugging Face's names under the mixer."""
    names = ["in_proj.weight", "conv1d.weight", "A_log", "D", "out_proj.weight"]
    names += ["conv1d.bias"] if m.conv_bias else []
    names += ["in_proj.bias", "out_proj.bias"] if m.proj_bias else []
    if isinstance(m, Mamba):
        names += ["x_proj.weight", "dt_proj.weight", "dt_proj.bias"]
        names += [f"{x}_layernorm.weight" for x in ("dt", "b", "c")] if m.inner_norms else []
    else:
        names += ["dt_bias", "norm.weight"]
    return {me + n: Source((hf + n,)) for n in names}


def mamba_names(spec: ModelSpec) -> dict[str, Source]:
    """mamba, falcon_mamba, mamba2: backbone.embeddings, backbone.layers.N.{norm, mixer.*}, backbone.norm_f."""
    out = _ends(spec, "backbone.embeddings.weight", "backbone.norm_f.weight")
    for i, layer in enumerate(spec.layers):
        hf = f"backbone.layers.{i}."
        out[f"layers.{i}.attn_norm.weight"] = Source((hf + "norm.weight",))
        out.update(ssm_mixer_names(layer.mixer, hf + "mixer.", f"layers.{i}.attn."))
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


def _hybrid_ffn(f: MLP | MoE, hf: str, me: str, router: str) -> dict[str, Source]:
    """A hybrid's channel mixer: a dense MLP, or router (+ correction bias) + experts.E + shared_experts."""
    if isinstance(f, MLP):
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
        if isinstance(layer.mixer, Mamba):
            out.update(ssm_mixer_names(layer.mixer, hf + "mamba.", me + "attn."))
        else:
            out.update(_attention_names(spec, i, hf + "self_attn.", me + "attn."))
        out.update(_hybrid_ffn(layer.ffn, hf + "feed_forward.", me + "mlp.", "router"))
        out[me + "attn_norm.weight"] = Source((hf + "input_layernorm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "pre_ff_layernorm.weight",))
    return out


def nemotron_h_names(spec: ModelSpec) -> dict[str, Source]:
    """backbone.layers.N.{norm, mixer.*}: the mixer is Mamba-2, attention, an MLP or an MoE; backbone.norm_f."""
    out = _ends(spec, "backbone.embeddings.weight", "backbone.norm_f.weight")
    for i, layer in enumerate(spec.layers):
        hf, me = f"backbone.layers.{i}.", f"layers.{i}."
        if isinstance(layer.mixer, Mamba2):
            out.update(ssm_mixer_names(layer.mixer, hf + "mixer.", me + "attn."))
        elif layer.mixer is not None:
            out.update(_attention_names(spec, i, hf + "mixer.", me + "attn."))
        else:
            out.update(_hybrid_ffn(layer.ffn, hf + "mixer.", me + "mlp.", "gate"))
        norm = "attn_norm" if layer.mixer is not None else "ffn_norm"  # the block's one norm
        out[f"{me}{norm}.weight"] = Source((hf + "norm.weight",))
    return out


SSM_FAMILIES = ("mamba", "falcon_mamba", "mamba2")
NAME_MAPS: dict[str, Callable[[ModelSpec], dict[str, Source]]] = {
    "gpt2": gpt2_names, **{f: llama_names for f in ENGINE_FAMILIES if f != "gpt2"},
    **{f: mamba_names for f in SSM_FAMILIES}, "jamba": jamba_names, "nemotron_h": nemotron_h_names}

# Other spellings of the same tensors: bare GPT-2 checkpoints, multimodal Gemma 3 (v5, then v4 names), older Mamba.
PREFIX_ALTERNATIVES = [("transformer.", ""), ("model.", "model.language_model."), ("model.", "language_model.model."),
                       ("lm_head.", "language_model.lm_head."), ("backbone.embeddings.", "backbone.embedding.")]


class Checkpoint:
    """The tensors of a safetensors checkpoint directory, single file or sharded, read lazily."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            with safe_open(path / "model.safetensors", "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise KvwallError(f"{path} has no model.safetensors or model.safetensors.index.json; "
                              "save the model with safetensors (save_pretrained does by default)")
        self.path, self.weight_map = path, weight_map

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
        with safe_open(self.path / self.weight_map[found], "pt") as f:
            return f.get_tensor(found)


def _assemble(ckpt: Checkpoint, src: Source) -> torch.Tensor:
    parts = [ckpt.get(n) for n in src.names]
    parts = [p.T if src.transpose else p for p in parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def load_model(path: str | Path, dtype: str | torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    """config.json + safetensors in `path` (or a .gguf file) -> an engine Transformer in eval mode."""
    path = Path(path).expanduser()
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise KvwallError(f"dtype {dtype} is not one the engine loads (float32, bfloat16, float16)")
    if path.suffix.lower() == ".gguf":  # llama.cpp's single-file format: its own loader, same name maps
        from kvwall.engine.gguf import load_gguf

        return load_gguf(path, dtype, device)
    if not (path / "config.json").is_file():
        raise KvwallError(f"{path} is not a checkpoint directory (no config.json)")
    spec = spec_from_config(read_config_file(path / "config.json"), name=path.name, where=str(path / "config.json"))
    check_supported(spec)
    with torch.device("meta"):
        model = Transformer(spec)
    state = load_state(Checkpoint(path), model, dtype)
    model.load_state_dict(state, assign=True)  # rotary tables are non-persistent buffers, built on the CPU
    assert not any(p.is_meta for p in model.parameters()), "every parameter comes from the checkpoint"
    return model.to(device).eval()


def load_state(ckpt: Checkpoint, model: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every engine parameter from the checkpoint, shape-checked, converted to dtype."""
    names = NAME_MAPS[model.spec.model_type](model.spec)
    expected = dict(model.named_parameters())
    assert set(names) == set(expected), sorted(set(names) ^ set(expected))
    state = {}
    for me, src in names.items():
        t = _assemble(ckpt, src)
        if tuple(t.shape) != tuple(expected[me].shape):
            raise KvwallError(f"{ckpt.path}: tensor {' + '.join(src.names)} has shape {tuple(t.shape)}, the config "
                              f"implies {tuple(expected[me].shape)}; the weights do not match config.json")
        state[me] = t.to(dtype).contiguous()
    return state
