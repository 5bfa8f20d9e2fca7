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
from kvwall.spec.model import ModelSpec
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
    hf, me = f"model.layers.{i}.", f"layers.{i}."
    attn, mlp = spec.layers[i].mixer, spec.layers[i].ffn
    out = {}
    if spec.model_type == "phi3":  # already fused
        out[me + "attn.wqkv.weight"] = Source((hf + "self_attn.qkv_proj.weight",))
        out[me + "mlp.w13.weight"] = Source((hf + "mlp.gate_up_proj.weight",))
    else:
        out[me + "attn.wqkv.weight"] = Source(tuple(hf + f"self_attn.{x}_proj.weight" for x in "qkv"))
        out[me + "mlp.w13.weight"] = Source((hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"))
    if attn.qkv_bias:
        out[me + "attn.wqkv.bias"] = Source(tuple(hf + f"self_attn.{x}_proj.bias" for x in "qkv"))
    out[me + "attn.wo.weight"] = Source((hf + "self_attn.o_proj.weight",))
    if attn.o_bias:
        out[me + "attn.wo.bias"] = Source((hf + "self_attn.o_proj.bias",))
    if attn.qk_norm:
        out[me + "attn.q_norm.weight"] = Source((hf + "self_attn.q_norm.weight",))
        out[me + "attn.k_norm.weight"] = Source((hf + "self_attn.k_norm.weight",))
    out[me + "mlp.w2.weight"] = Source((hf + "mlp.down_proj.weight",))
    if mlp.bias:
        out[me + "mlp.w13.bias"] = Source((hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias"))
        out[me + "mlp.w2.bias"] = Source((hf + "mlp.down_proj.bias",))
    out[me + "attn_norm.weight"] = Source((hf + "input_layernorm.weight",))
    if spec.sandwich_norms:  # Gemma: post_attention_layernorm is the attention output's norm
        out[me + "post_attn_norm.weight"] = Source((hf + "post_attention_layernorm.weight",))
        out[me + "ffn_norm.weight"] = Source((hf + "pre_feedforward_layernorm.weight",))
        out[me + "post_ffn_norm.weight"] = Source((hf + "post_feedforward_layernorm.weight",))
    else:
        out[me + "ffn_norm.weight"] = Source((hf + "post_attention_layernorm.weight",))
    return out


def llama_names(spec: ModelSpec) -> dict[str, Source]:
    out = {"embed.weight": Source(("model.embed_tokens.weight",)), "norm.weight": Source(("model.norm.weight",))}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = Source(("lm_head.weight",))
    for i in range(spec.n_layers):
        out.update(_llama_layer(spec, i))
    return out


def gpt2_names(spec: ModelSpec) -> dict[str, Source]:
    out = {"embed.weight": Source(("transformer.wte.weight",)), "pos_embed.weight": Source(("transformer.wpe.weight",)),
           "norm.weight": Source(("transformer.ln_f.weight",)), "norm.bias": Source(("transformer.ln_f.bias",))}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = Source(("lm_head.weight",))
    pairs = [("ln_1", "attn_norm", False), ("attn.c_attn", "attn.wqkv", True), ("attn.c_proj", "attn.wo", True),
             ("ln_2", "ffn_norm", False), ("mlp.c_fc", "mlp.w1", True), ("mlp.c_proj", "mlp.w2", True)]
    for i in range(spec.n_layers):
        for hf, me, conv1d in pairs:
            out[f"layers.{i}.{me}.weight"] = Source((f"transformer.h.{i}.{hf}.weight",), transpose=conv1d)
            out[f"layers.{i}.{me}.bias"] = Source((f"transformer.h.{i}.{hf}.bias",))
    return out


NAME_MAPS: dict[str, Callable[[ModelSpec], dict[str, Source]]] = {
    "gpt2": gpt2_names, **{f: llama_names for f in ENGINE_FAMILIES if f != "gpt2"}}

# Other spellings of the same tensors: bare GPT-2 checkpoints, multimodal Gemma 3 (v5, then v4 names).
PREFIX_ALTERNATIVES = [("transformer.", ""), ("model.", "model.language_model."), ("model.", "language_model.model."),
                       ("lm_head.", "language_model.lm_head.")]


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
    """config.json + safetensors in `path` -> an engine Transformer in eval mode."""
    path = Path(path).expanduser()
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise KvwallError(f"dtype {dtype} is not one the engine loads (float32, bfloat16, float16)")
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
