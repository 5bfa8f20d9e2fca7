"""The family registry: one entry per Hugging Face ``model_type``.

Each entry says how its config.json becomes a ModelSpec (``parse``), which checkpoint layout the
engine loads its weights from (``layout``: the tensor-name map in ``kvwall.engine.load.LAYOUTS``), and,
when the engine does not run it, why. Every supported list (the parsers, the engine's families,
``kvwall models``, the README) is derived from ``FAMILIES``; nothing else keeps a list of model types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvwall.spec import hf
from kvwall.spec.model import ModelSpec


@dataclass(frozen=True)
class Family:
    model_type: str
    parse: Callable[[hf.Config, str], ModelSpec]
    layout: str | None  # checkpoint layout the engine loads (engine/load.py LAYOUTS); None: the predictor only
    why_not: str = ""  # when layout is None: what the engine lacks

    @property
    def runs_in_engine(self) -> bool:
        return self.layout is not None


FAMILIES: dict[str, Family] = {f.model_type: f for f in [
    Family("gpt2", hf.parse_gpt2, "gpt2"),
    Family("llama", hf.parse_llama, "llama"),
    Family("mistral", hf.parse_llama, "llama"),
    Family("mixtral", hf.parse_mixtral, "mixtral"),
    Family("qwen2", hf.parse_qwen2, "llama"),
    Family("qwen3", hf.parse_qwen3, "llama"),
    Family("qwen2_moe", hf.parse_qwen_moe, "llama"),
    Family("qwen3_moe", hf.parse_qwen_moe, "llama"),
    Family("phi3", hf.parse_phi3, "phi3"),
    Family("gemma2", hf.parse_gemma2, "llama"),
    Family("gemma3_text", hf.parse_gemma3_text, "llama"),
    Family("gemma3", hf.parse_gemma3, "llama"),
    Family("deepseek_v2", hf.parse_deepseek, "llama"),
    Family("deepseek_v3", hf.parse_deepseek, "llama"),
    Family("mamba", hf.parse_mamba, "mamba"),
    Family("falcon_mamba", hf.parse_mamba, "mamba"),
    Family("mamba2", hf.parse_mamba2, "mamba"),
    Family("jamba", hf.parse_jamba, "jamba"),
    Family("nemotron_h", hf.parse_nemotron_h, "nemotron_h"),
    Family("qwen3_next", hf.parse_qwen3_next, "llama"),  # Gated DeltaNet layers under linear_attn.
    Family("qwen3_5_text", hf.parse_qwen3_next, "llama"),
    Family("qwen3_5_moe_text", hf.parse_qwen3_next, "llama"),
    # The multimodal Qwen3.5 releases: the language model alone would run as qwen3_5_text / qwen3_5_moe_text once the
    # loader maps model.language_model.* to the text layout and skips model.visual.* (and the decoder takes mrope's
    # text positions, which equal plain RoPE without images); not built.
    Family("qwen3_5", hf.parse_qwen3_5, None, "the engine does not run the Qwen3.5 vision tower yet"),
    Family("qwen3_5_moe", hf.parse_qwen3_5, None, "the engine does not run the Qwen3.5 vision tower yet"),
    Family("falcon_h1", hf.parse_falcon_h1, "falcon_h1"),  # parallel attention + Mamba-2: layers/parallel_hybrid.py
    Family("lfm2", hf.parse_lfm2, "lfm2"),  # short convolutions: engine/layers/short_conv.py
    Family("gpt_oss", hf.parse_gpt_oss, "gpt_oss"),  # attention sinks, experts in 3-D tensors
    Family("llama4_text", hf.parse_llama4_text, "llama4"),  # chunked / NoPE layers, experts in 3-D tensors
    Family("llama4", hf.parse_llama4, "llama4"),  # its text decoder (language_model.*); the vision tower unused
    Family("deepseek_v32", hf.parse_deepseek_v32, "llama"),  # DeepSeek Sparse Attention: layers/sparse_latent.py
    Family("granitemoehybrid", hf.parse_granitemoehybrid, "granitemoehybrid"),  # Mamba-2 + attention, muP
    Family("kimi_linear", hf.parse_kimi_linear, "kimi_linear"),  # Kimi Delta Attention: layers/kda.py, NoPE MLA
    Family("minimax", hf.parse_minimax, "mixtral"),  # lightning attention: layers/lightning.py; alpha/beta residual
    # state-spaces' own checkpoints: no model_type; spec_from_config recognises d_model + n_layer
    Family("mamba_ssm", hf.parse_mamba_ssm, None, "the state-spaces checkpoint layout is not mapped"),
]}


def supported() -> list[str]:
    """Every model_type the predictor parses (mamba_ssm is found by its fields, not named)."""
    return sorted(t for t in FAMILIES if t != "mamba_ssm")


def engine_families() -> list[str]:
    return [t for t, f in FAMILIES.items() if f.runs_in_engine]


def family(model_type: str) -> Family | None:
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None
