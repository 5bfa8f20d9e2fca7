"""Hugging Face ``config.json`` -> ModelSpec.

This is the only module that knows Hugging Face field names. One parser per
family; a new architecture is a new function plus one entry in ``kvwall.spec.families``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvwall.errors import KvwallError
from kvwall.spec import validate
from kvwall.spec.formats import checkpoint_weights
from kvwall.spec.model import (
    MLP,
    Attention,
    GatedDeltaNet,
    LatentAttention,
    Layer,
    Mamba,
    Mamba2,
    ModelSpec,
    MoE,
    Rope,
    Routing,
    dt_rank_auto,
)

_MISSING = object()


class Config:
    """A config dict plus where it came from, so a missing field names its file."""

    def __init__(self, data: dict[str, Any], where: str):
        self.data = data
        self.where = where

    def req(self, *keys: str) -> Any:
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        names = " or ".join(repr(k) for k in keys)
        mt = self.data.get("model_type", "?")
        raise KvwallError(f"{self.where} has no {names} (needed for model_type {mt!r}); add it to the config")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key, _MISSING)
        return default if value is _MISSING or value is None else value

    def positive(self, *keys: str) -> int:
        value = self.req(*keys)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise KvwallError(f"{self.where}: {keys[0]!r} is {value!r}; it must be a positive integer")
        return value


def _dtype(c: Config) -> str | None:
    return c.get("torch_dtype") or c.get("dtype")


def _windows(c: Config, n_layers: int, default_sliding: Callable[[int], bool] | None) -> list[int | None]:
    """Per-layer sliding window: from `layer_types` when present, else the family's rule."""
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if types is not None:
        if len(types) != n_layers:
            raise KvwallError(f"{c.where}: layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
        out: list[int | None] = []
        for t in types:
            if t == "full_attention":
                out.append(None)
            elif t == "sliding_attention":
                if not window:
                    raise KvwallError(f"{c.where}: layer_types says sliding_attention but sliding_window is not set")
                out.append(int(window))
            else:
                raise KvwallError(f"{c.where}: layer type {t!r} is not supported (full_attention, sliding_attention)")
        return out
    if not window or default_sliding is None:
        return [None] * n_layers
    return [int(window) if default_sliding(i) else None for i in range(n_layers)]


def _attention(c: Config, hidden: int, *, qkv_bias=False, o_bias=False, qk_norm=False, window=None, theta=None,
               rope: Rope | None = None):
    n_q = c.positive("num_attention_heads")
    n_kv = c.get("num_key_value_heads") or n_q
    head_dim = c.get("head_dim") or hidden // n_q
    if n_q % n_kv:
        raise KvwallError(f"{c.where}: num_attention_heads {n_q} is not a multiple of num_key_value_heads {n_kv}")
    rope = rope or _rope(c)
    if theta is not None:
        rope = replace(rope, theta=float(theta))
    return Attention(n_q, n_kv, head_dim, head_dim, window, qkv_bias, o_bias, qk_norm, rope=rope)


# -- engine details: rotary scaling, norms, activations, special tokens -----

def _rope(c: Config, layer_type: str | None = None) -> Rope:
    """Rotary parameters from transformers v5 ``rope_parameters`` (optionally keyed by layer type)
    or from the v4 fields ``rope_theta`` + ``rope_scaling``."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        params = params.get(layer_type or "full_attention") or params.get("full_attention")
    if not isinstance(params, dict) or not params:
        params = dict(c.get("rope_scaling") or {})
        params.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    rope = Rope(
        theta=float(params.get("rope_theta") or c.get("rope_theta", 10000.0)), kind=str(kind),
        factor=float(params.get("factor") or 1.0), low_freq_factor=float(params.get("low_freq_factor") or 1.0),
        high_freq_factor=float(params.get("high_freq_factor") or 4.0),
        original_max_position=params.get("original_max_position_embeddings"),
        partial=float(params.get("partial_rotary_factor") or c.get("partial_rotary_factor", 1.0)),
    )
    return replace(rope, **_yarn(c, params)) if kind == "yarn" else rope


def _yarn(c: Config, params: dict) -> dict:
    """YaRN's extra fields; a missing factor is max_position_embeddings / original (as transformers does)."""
    original = params.get("original_max_position_embeddings")
    if not original:
        raise KvwallError(f"{c.where}: yarn rope scaling needs original_max_position_embeddings; add it")
    factor = params.get("factor") or c.get("max_position_embeddings", original) / original
    opt = lambda key: None if params.get(key) is None else float(params[key])  # noqa: E731
    return {"factor": float(factor), "beta_fast": float(params.get("beta_fast") or 32.0),
            "beta_slow": float(params.get("beta_slow") or 1.0), "mscale": opt("mscale"),
            "mscale_all_dim": opt("mscale_all_dim"), "attention_factor": opt("attention_factor"),
            "truncate": bool(params.get("truncate", True))}


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "relu": "relu", "relu2": "relu2"}


def _activation(c: Config, *keys: str, default: str = "silu") -> str:
    """The MLP activation, canonical name (an unknown name is kept: the engine says it cannot run it)."""
    for key in keys:
        if c.get(key):
            return _ACTIVATIONS.get(c.get(key), c.get(key))
    return default


def _tokens(c: Config) -> dict:
    eos = c.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return {"bos_token_id": c.get("bos_token_id"), "eos_token_ids": eos_ids, "pad_token_id": c.get("pad_token_id")}


def _decoder(c: Config, name: str, layers: list[Layer], *, tied: bool, final_norm: int, hidden: int,
             vocab: int | None = None, pos: int = 0, extra: int = 0, notes=()) -> ModelSpec:
    return ModelSpec(
        name=name, model_type=c.req("model_type"), hidden=hidden, vocab=vocab or c.positive("vocab_size"),
        layers=tuple(layers), tied_embeddings=tied, position_embeddings=pos, final_norm_params=final_norm,
        max_context=c.get("max_position_embeddings"), dtype=_dtype(c), extra_params=extra, notes=tuple(notes),
        **_tokens(c),
    )


# -- families ---------------------------------------------------------------

def parse_gpt2(c: Config, name: str) -> ModelSpec:
    d = c.positive("n_embd", "hidden_size")
    n_layer = c.positive("n_layer", "num_hidden_layers")
    n_head = c.positive("n_head", "num_attention_heads")
    d_ff = c.get("n_inner") or 4 * d
    attn = Attention(n_head, n_head, d // n_head, d // n_head, None, qkv_bias=True, o_bias=True)
    mlp = MLP(d_ff, gated=False, bias=True, activation=_activation(c, "activation_function", default="gelu_tanh"))
    layer = Layer(attn, mlp, norm_params=4 * d)  # two LayerNorms, weight + bias
    n_pos = c.positive("n_positions", "max_position_embeddings")
    spec = _decoder(c, name, [layer] * n_layer, tied=c.get("tie_word_embeddings", True), final_norm=2 * d,
                    hidden=d, pos=n_pos, notes=["learned absolute positions (wpe)"])
    return replace(spec, max_context=n_pos, norm="layer", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)))


def _llama_family(c: Config, name: str, *, qkv_bias: bool, qk_norm: bool = False,
                  sliding_rule: Callable[[int], bool] | None = lambda i: True,
                  ffn: Callable[[int], Any] | None = None) -> ModelSpec:
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    bias = bool(c.get("attention_bias", False))
    windows = _windows(c, n, sliding_rule)
    dense = MLP(c.positive("intermediate_size"), gated=True, bias=bool(c.get("mlp_bias", False)),
                activation=_activation(c, "hidden_act")) if ffn is None else None
    layers = []
    for i in range(n):
        attn = _attention(c, hidden, qkv_bias=qkv_bias or bias, o_bias=bias, qk_norm=qk_norm, window=windows[i])
        layers.append(Layer(attn, dense if ffn is None else ffn(i), norm_params=2 * hidden))
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", False)), final_norm=hidden, hidden=hidden)
    return replace(spec, norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def parse_llama(c: Config, name: str) -> ModelSpec:
    return _llama_family(c, name, qkv_bias=False)


def parse_qwen2(c: Config, name: str) -> ModelSpec:
    return _llama_family(c, name, qkv_bias=True, sliding_rule=_qwen_sliding(c))


def parse_qwen3(c: Config, name: str) -> ModelSpec:
    return _llama_family(c, name, qkv_bias=False, qk_norm=True, sliding_rule=_qwen_sliding(c))


def _qwen_sliding(c: Config) -> Callable[[int], bool] | None:
    """Qwen2/3: sliding only when use_sliding_window, and only for layers >= max_window_layers."""
    if not c.get("use_sliding_window", False):
        return None
    start = c.get("max_window_layers", 0)
    return lambda i: i >= start


def _moe_from(c: Config, experts_key: str, width_key: str, **kw) -> MoE:
    return MoE(c.positive(experts_key), c.positive("num_experts_per_tok"), c.positive(width_key), **kw)


def parse_mixtral(c: Config, name: str) -> ModelSpec:
    moe = _moe_from(c, "num_local_experts", "intermediate_size")
    return _llama_family(c, name, qkv_bias=False, ffn=lambda i: moe)


def parse_qwen_moe(c: Config, name: str) -> ModelSpec:
    """qwen2_moe / qwen3_moe: MoE on layers (i+1) % decoder_sparse_step == 0 not in mlp_only_layers."""
    shared = c.get("shared_expert_intermediate_size", 0)
    moe = MoE(c.positive("num_experts", "num_local_experts"),  # transformers 5 saves num_local_experts
              c.positive("num_experts_per_tok"), c.positive("moe_intermediate_size"), n_shared=1 if shared else 0,
              d_shared=shared, shared_gate=bool(shared),
              routing=Routing(normalize=bool(c.get("norm_topk_prob", False))))
    dense = MLP(c.positive("intermediate_size"))
    step = c.get("decoder_sparse_step", 1)
    dense_only = set(c.get("mlp_only_layers", []))

    def ffn(i: int):
        return moe if (i not in dense_only and (i + 1) % step == 0) else dense

    qwen3 = c.req("model_type") == "qwen3_moe"
    return _llama_family(c, name, qkv_bias=not qwen3, qk_norm=qwen3, sliding_rule=_qwen_sliding(c), ffn=ffn)


def parse_phi3(c: Config, name: str) -> ModelSpec:
    return _llama_family(c, name, qkv_bias=False)


# Gemma 3 text defaults (transformers Gemma3TextConfig), for multimodal configs whose
# text_config lists only the fields that differ.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window": 4096,
    "sliding_window_pattern": 6, "tie_word_embeddings": True, "model_type": "gemma3_text",
}


def _gemma(c: Config, name: str, *, qk_norm: bool, sliding_rule, local_theta=None, extra=0, notes=()) -> ModelSpec:
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    windows = _windows(c, n, sliding_rule)
    mlp = MLP(c.positive("intermediate_size"), gated=True,
              activation=_activation(c, "hidden_activation", "hidden_act", default="gelu_tanh"))
    scalar = c.get("query_pre_attn_scalar")
    layers = []
    for i in range(n):
        local = bool(windows[i] and local_theta)
        # v5 configs key rope_parameters by layer type; v4 configs give the local base as rope_local_base_freq
        rope = _rope(c, "sliding_attention" if local else "full_attention")
        if local and not isinstance(c.get("rope_parameters"), dict):
            rope = Rope(theta=local_theta)
        attn = _attention(c, hidden, qkv_bias=bool(c.get("attention_bias", False)), qk_norm=qk_norm,
                          window=windows[i], rope=rope)
        attn = replace(attn, scale=float(scalar) ** -0.5 if scalar else None, softcap=c.get("attn_logit_softcapping"))
        layers.append(Layer(attn, mlp, norm_params=4 * hidden))  # input, post-attn, pre-ffn, post-ffn
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", True)), final_norm=hidden,
                    hidden=hidden, extra=extra, notes=notes)
    return replace(spec, norm="rms1p", norm_eps=float(c.get("rms_norm_eps", 1e-6)), sandwich_norms=True,
                   embed_scale=hidden ** 0.5, final_softcap=c.get("final_logit_softcapping"))


def parse_gemma2(c: Config, name: str) -> ModelSpec:
    return _gemma(c, name, qk_norm=False, sliding_rule=lambda i: i % 2 == 0)


def parse_gemma3_text(c: Config, name: str) -> ModelSpec:
    pattern = c.get("sliding_window_pattern", 6)
    return _gemma(c, name, qk_norm=True, sliding_rule=lambda i: (i + 1) % pattern != 0,
                  local_theta=float(c.get("rope_local_base_freq", 10_000.0)))


def parse_gemma3(c: Config, name: str) -> ModelSpec:
    """Multimodal Gemma 3: the language model is text_config (over Gemma3TextConfig defaults)."""
    text = dict(GEMMA3_TEXT_DEFAULTS)
    text.update({k: v for k, v in c.req("text_config").items() if v is not None})
    text.setdefault("torch_dtype", _dtype(c))
    vision = c.get("vision_config")
    extra, notes = 0, []
    if vision:
        extra = siglip_params(Config(vision, c.where + " vision_config"), text["hidden_size"])
        notes.append(f"includes the SigLIP vision tower and projector ({extra:,} parameters)")
    spec = parse_gemma3_text(Config(text, c.where + " text_config"), name)
    return replace(spec, model_type="gemma3", extra_params=extra, notes=spec.notes + tuple(notes))


def siglip_params(v: Config, text_hidden: int) -> int:
    """SigLIP vision encoder + Gemma 3's multimodal projector (parameter count only)."""
    d = v.positive("hidden_size")
    ff = v.positive("intermediate_size")
    patch = v.positive("patch_size")
    image = v.positive("image_size")
    channels = v.get("num_channels", 3)
    embed = channels * patch * patch * d + d + (image // patch) ** 2 * d
    layer = 4 * (d * d + d) + 2 * (d * ff) + ff + d + 2 * 2 * d  # attention, MLP, two LayerNorms
    post_norm = 2 * d
    projector = d * text_hidden + d  # mm_input_projection_weight + mm_soft_emb_norm
    return embed + v.positive("num_hidden_layers") * layer + post_norm + projector


def parse_deepseek(c: Config, name: str) -> ModelSpec:
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    mla = LatentAttention(
        n_heads=c.positive("num_attention_heads"), kv_lora_rank=c.positive("kv_lora_rank"),
        q_lora_rank=c.get("q_lora_rank"), qk_nope_head_dim=c.positive("qk_nope_head_dim"),
        qk_rope_head_dim=c.positive("qk_rope_head_dim"), v_head_dim=c.positive("v_head_dim"),
        bias=bool(c.get("attention_bias", False)),
    )
    v2 = c.req("model_type") == "deepseek_v2"
    rope = replace(_rope(c), interleaved=v2 or bool(c.get("rope_interleave", True)))  # V2 always pairs
    mla = replace(mla, rope=rope, scale=mla.qk_head_dim ** -0.5 * _deepseek_mscale(rope) ** 2)
    dense = MLP(c.positive("intermediate_size"))
    moe = None
    if c.get("n_routed_experts"):
        width = c.positive("moe_intermediate_size")
        moe = MoE(c.positive("n_routed_experts"), c.positive("num_experts_per_tok"), width,
                  n_shared=c.get("n_shared_experts", 0), routing=_deepseek_routing(c, v2))
    first_dense = c.get("first_k_dense_replace", 0)
    freq = c.get("moe_layer_freq", 1)
    layers = [Layer(mla, moe if (moe and i >= first_dense and i % freq == 0) else dense, norm_params=2 * hidden)
              for i in range(n)]
    notes = []
    if c.get("num_nextn_predict_layers"):
        notes.append(f"{c.get('num_nextn_predict_layers')} multi-token-prediction layer(s) not counted "
                     "(transformers does not load them)")
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", False)), final_norm=hidden,
                    hidden=hidden, notes=notes)
    return replace(spec, norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def _deepseek_mscale(rope: Rope) -> float:
    """YaRN's softmax-scale correction 0.1 * mscale_all_dim * ln(factor) + 1 (1 without scaling)."""
    if rope.kind == "default" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    return 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0


def _deepseek_routing(c: Config, v2: bool) -> Routing:
    """V2: softmax, group-limited only for topk_method group_limited_greedy, weights scaled, not normalised
    (transformers ignores V2's norm_topk_prob); V3: sigmoid + correction bias, groups by their best two."""
    scale = float(c.get("routed_scaling_factor", 1.0))
    if v2:
        grouped = c.get("topk_method") == "group_limited_greedy"
        return Routing("softmax", n_group=c.get("n_group", 1) if grouped else 1,
                       topk_group=c.get("topk_group", 1) if grouped else 1, normalize=False, scale=scale)
    return Routing("sigmoid", bias=True, n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1),
                   group_score="top2", normalize=bool(c.get("norm_topk_prob", True)), scale=scale)


def parse_mamba(c: Config, name: str) -> ModelSpec:
    hidden = c.positive("hidden_size")
    dt_rank = c.get("time_step_rank", "auto")
    mixer = Mamba(
        d_inner=c.get("intermediate_size") or c.get("expand", 2) * hidden, d_state=c.positive("state_size"),
        d_conv=c.positive("conv_kernel"), dt_rank=dt_rank_auto(hidden) if dt_rank == "auto" else int(dt_rank),
        conv_bias=bool(c.get("use_conv_bias", True)), proj_bias=bool(c.get("use_bias", False)),
        weightless_norms=c.req("model_type") == "falcon_mamba", inner_norm_eps=float(c.get("mixer_rms_eps", 1e-6)),
    )
    layers = [Layer(mixer, None, norm_params=hidden)] * c.positive("num_hidden_layers", "n_layer")
    notes = ["falcon_mamba: RMS norms on B, C, dt have no weights"] if c.req("model_type") == "falcon_mamba" else []
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", True)), final_norm=hidden,
                    hidden=hidden, notes=notes)
    return replace(spec, norm_eps=float(c.get("layer_norm_epsilon", 1e-5)))


def _dt_limit(c: Config) -> tuple[float, float]:
    """The range the Mamba-2 step size Δ is clamped to: time_step_limit (Nemotron-H's remote code also says
    mamba_dt_limit), default (0, inf) = no clamp. transformers < 5.25 clamped Nemotron-H's prefill at
    time_step_min instead; 5.25 reads time_step_limit as mamba_ssm does, and so do we."""
    return tuple(validate.json_float(x) for x in c.get("time_step_limit", c.get("mamba_dt_limit", (0.0, math.inf))))


def parse_mamba2(c: Config, name: str) -> ModelSpec:
    hidden = c.positive("hidden_size")
    mixer = Mamba2(
        n_heads=c.positive("num_heads"), head_dim=c.positive("head_dim"), d_state=c.positive("state_size"),
        n_groups=c.get("n_groups", 1), d_conv=c.positive("conv_kernel"),
        conv_bias=bool(c.get("use_conv_bias", True)), proj_bias=bool(c.get("use_bias", False)),
        dt_limit=_dt_limit(c),
    )
    expand = c.get("expand", 2)
    if mixer.d_inner != int(expand * hidden):
        raise KvwallError(f"{c.where}: num_heads x head_dim = {mixer.d_inner} but expand x hidden_size = "
                          f"{int(expand * hidden)}; fix one of them")
    if mixer.n_heads % mixer.n_groups:
        raise KvwallError(f"{c.where}: n_groups = {mixer.n_groups} does not divide num_heads = {mixer.n_heads}")
    layers = [Layer(mixer, None, norm_params=hidden)] * c.positive("num_hidden_layers")
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", False)), final_norm=hidden, hidden=hidden)
    return replace(spec, norm_eps=float(c.get("layer_norm_epsilon", 1e-5)))


def parse_mamba_ssm(c: Config, name: str) -> ModelSpec:
    """state-spaces `mamba_ssm` format (d_model, n_layer, ssm_cfg): Mamba or Mamba-2, optional attention."""
    d = c.positive("d_model")
    ssm = c.get("ssm_cfg", {})
    expand = ssm.get("expand", 2)
    if ssm.get("layer", "Mamba1") == "Mamba2":
        d_inner = expand * d
        head_dim = ssm.get("headdim", 64)
        mixer: Any = Mamba2(d_inner // head_dim, head_dim, ssm.get("d_state", 128), ssm.get("ngroups", 1),
                            ssm.get("d_conv", 4), ssm.get("conv_bias", True), ssm.get("bias", False))
    else:
        dt = ssm.get("dt_rank", "auto")
        mixer = Mamba(expand * d, ssm.get("d_state", 16), ssm.get("d_conv", 4),
                      dt_rank_auto(d) if dt == "auto" else int(dt), ssm.get("conv_bias", True), ssm.get("bias", False))
    attn_idx = set(c.get("attn_layer_idx", []))
    attn_cfg = c.get("attn_cfg", {})
    d_ff = c.get("d_intermediate", 0)
    layers = []
    for i in range(c.positive("n_layer")):
        norms = d * (2 if d_ff else 1)
        if i in attn_idx:
            n_q = attn_cfg.get("num_heads", 1)
            hd = attn_cfg.get("head_dim") or d // n_q
            m: Any = Attention(n_q, attn_cfg.get("num_heads_kv") or n_q, hd, hd,
                               qkv_bias=attn_cfg.get("qkv_proj_bias", True), o_bias=attn_cfg.get("out_proj_bias", True))
        else:
            m = mixer
        layers.append(Layer(m, MLP(d_ff) if d_ff else None, norm_params=norms))
    vocab = c.positive("vocab_size")
    multiple = c.get("pad_vocab_size_multiple", 1)
    padded = -(-vocab // multiple) * multiple
    data = dict(c.data, model_type="mamba_ssm")
    return _decoder(Config(data, c.where), name, layers, tied=bool(c.get("tie_embeddings", True)), final_norm=d,
                    hidden=d, vocab=padded, notes=[f"vocab {vocab} padded to {padded} (multiple of {multiple})"])


def parse_jamba(c: Config, name: str) -> ModelSpec:
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    dt = c.get("mamba_dt_rank", "auto")
    eps = float(c.get("rms_norm_eps", 1e-6))
    mamba = Mamba(c.get("mamba_expand", 2) * hidden, c.get("mamba_d_state", 16), c.get("mamba_d_conv", 4),
                  dt_rank_auto(hidden) if dt == "auto" else int(dt), bool(c.get("mamba_conv_bias", True)),
                  bool(c.get("mamba_proj_bias", False)), inner_norms=True, inner_norm_eps=eps)
    act = _activation(c, "hidden_act")
    dense = MLP(c.positive("intermediate_size"), activation=act)
    n_exp = c.get("num_experts") or c.get("num_local_experts", 1)
    moe = MoE(n_exp, c.positive("num_experts_per_tok"), c.positive("intermediate_size"),
              routing=Routing(normalize=False), activation=act) if n_exp > 1 else dense  # softmax top-k, as is
    a_period, a_offset = c.get("attn_layer_period", 8), c.get("attn_layer_offset", 4)
    e_period, e_offset = c.get("expert_layer_period", 2), c.get("expert_layer_offset", 1)
    windows = _windows(c, n, lambda i: True)
    layers = []
    for i in range(n):
        # Jamba's attention has no positional embedding at all (the Mamba layers carry order)
        attn = replace(_attention(c, hidden, window=windows[i]), rope=None)
        mixer = attn if i % a_period == a_offset else mamba
        layers.append(Layer(mixer, moe if i % e_period == e_offset else dense, norm_params=2 * hidden))
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", False)), final_norm=hidden, hidden=hidden)
    return replace(spec, norm_eps=eps)


def parse_nemotron_h(c: Config, name: str) -> ModelSpec:
    """Nemotron-H: hybrid_override_pattern, one char per block: M Mamba-2, * attention, - MLP, E MoE
    (transformers 5 saves the same as the list layers_block_type instead)."""
    hidden = c.positive("hidden_size")
    pattern = _nemotron_pattern(c)
    n = c.get("num_hidden_layers", len(pattern))
    if len(pattern) != n:
        raise KvwallError(f"{c.where}: hybrid_override_pattern has {len(pattern)} blocks but num_hidden_layers is {n}")
    mamba = Mamba2(c.positive("mamba_num_heads"), c.positive("mamba_head_dim"), c.positive("ssm_state_size"),
                   c.get("n_groups", 1), c.get("conv_kernel", 4), bool(c.get("use_conv_bias", True)),
                   bool(c.get("use_bias", False)), dt_limit=_dt_limit(c))
    n_q = c.positive("num_attention_heads")
    hd = c.get("attention_head_dim") or c.get("head_dim") or hidden // n_q
    bias = bool(c.get("attention_bias", False))
    attn = Attention(n_q, c.get("num_key_value_heads") or n_q, hd, hd, None, bias, bias)  # no rotary positions
    act = _activation(c, "mlp_hidden_act", default="relu2")
    layers = []
    for ch in pattern:
        if ch == "M":
            layers.append(Layer(mamba, None, norm_params=hidden))
        elif ch == "*":
            layers.append(Layer(attn, None, norm_params=hidden))
        elif ch == "-":
            layers.append(Layer(None, MLP(c.positive("intermediate_size"), gated=False, bias=bool(c.get("mlp_bias")),
                                          activation=act), norm_params=hidden))
        elif ch == "E":
            routing = Routing("sigmoid", bias=True, n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1),
                              group_score="top2", normalize=bool(c.get("norm_topk_prob", True)),
                              scale=float(c.get("routed_scaling_factor", 1.0)))
            d_shared = c.get("moe_shared_expert_intermediate_size", 0)  # one shared MLP of this width, always
            moe = MoE(c.positive("n_routed_experts"), c.positive("num_experts_per_tok"),
                      c.positive("moe_intermediate_size"), n_shared=1 if d_shared else 0, d_shared=d_shared,
                      gated=False, routing=routing, activation=act)
            layers.append(Layer(None, moe, norm_params=hidden))
        else:
            raise KvwallError(f"{c.where}: hybrid_override_pattern has block {ch!r}; known blocks are M, *, -, E")
    latent = c.get("moe_latent_size") if "E" in pattern else None
    notes = [f"moe_latent_size {latent}: the experts' latent projections are not modelled"] if latent else []
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", False)), final_norm=hidden, hidden=hidden,
                    notes=notes)
    return replace(spec, norm_eps=float(c.get("layer_norm_epsilon", 1e-5)))


_NEMOTRON_BLOCKS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                    "moe": "E"}


def _nemotron_pattern(c: Config) -> str:
    """The block pattern string, from hybrid_override_pattern or transformers 5's layers_block_type list."""
    if c.get("hybrid_override_pattern") is not None:
        return str(c.get("hybrid_override_pattern"))
    types = c.get("layers_block_type")
    if not isinstance(types, list):
        c.req("hybrid_override_pattern", "layers_block_type")  # raises: names both fields
        raise KvwallError(f"{c.where}: layers_block_type must be a list of block types")
    unknown = sorted({t for t in types if t not in _NEMOTRON_BLOCKS})
    if unknown:
        raise KvwallError(f"{c.where}: layers_block_type has {unknown}; known are {', '.join(_NEMOTRON_BLOCKS)}")
    return "".join(_NEMOTRON_BLOCKS[t] for t in types)


# transformers 5.25's class defaults (configuration_qwen3_next.py, configuration_qwen3_5*.py), used where a
# config.json leaves a field out, as transformers does
_QWEN_LINEAR_DEFAULTS = {
    "qwen3_next": {"num_key_value_heads": 2, "num_experts": 512, "num_experts_per_tok": 10},
    "qwen3_5_text": {"num_key_value_heads": 4},
    "qwen3_5_moe_text": {"num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8},
}
_QWEN_LINEAR_SHARED = {"head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                       "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                       "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                       "decoder_sparse_step": 1, "full_attention_interval": 4, "partial_rotary_factor": 0.25}


def parse_qwen3_next(c: Config, name: str) -> ModelSpec:
    """Qwen3-Next / Qwen3.5 text: Gated DeltaNet ("linear_attention") layers beside gated full-attention layers.

    layer_types names each layer; without it every full_attention_interval-th layer (i + 1) % interval == 0 is
    full attention. Full attention: GQA with head_dim, q/k RMSNorm, q_proj twice as wide (the output gate),
    partial rotary (0.25). Channel mixer: qwen3_next: MoE (router, experts, one sigmoid-gated shared expert) on
    layers (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers, else a dense MLP of intermediate_size;
    qwen3_5_text: a dense MLP everywhere; qwen3_5_moe_text: MoE everywhere.
    """
    mt = c.req("model_type")
    defaults = _QWEN_LINEAR_SHARED | _QWEN_LINEAR_DEFAULTS[mt]
    get = lambda key: c.get(key, defaults[key])  # noqa: E731
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    types = c.get("layer_types")
    if types is None:
        interval = get("full_attention_interval")
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise KvwallError(f"{c.where}: full_attention_interval is {interval!r}; it must be a positive integer")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise KvwallError(f"{c.where}: layer_types must list one type per layer ({n}, num_hidden_layers)")
    unknown = sorted({str(t) for t in types if t not in ("linear_attention", "full_attention")})
    if unknown:
        raise KvwallError(f"{c.where}: layer_types has {unknown}; known are linear_attention, full_attention")
    n_q = c.positive("num_attention_heads")
    n_kv, hd = get("num_key_value_heads"), get("head_dim")
    bias = bool(c.get("attention_bias", False))
    rope = _rope(c)
    if not (isinstance(c.get("rope_parameters"), dict) and c.get("rope_parameters").get("partial_rotary_factor")):
        rope = replace(rope, partial=float(get("partial_rotary_factor")))
    attn = Attention(n_q, n_kv, hd, hd, None, bias, bias, qk_norm=True, output_gate=True, rope=rope)
    gdn = GatedDeltaNet(get("linear_num_key_heads"), get("linear_num_value_heads"), get("linear_key_head_dim"),
                        get("linear_value_head_dim"), get("linear_conv_kernel_dim"))
    act = _activation(c, "hidden_act")
    if mt == "qwen3_5_text":
        dense = MLP(c.positive("intermediate_size"), activation=act)
        ffn = lambda i: dense  # noqa: E731
    else:
        n_exp, shared = get("num_experts"), get("shared_expert_intermediate_size")
        moe = MoE(n_exp, get("num_experts_per_tok"), get("moe_intermediate_size"), n_shared=1 if shared else 0,
                  d_shared=shared, shared_gate=bool(shared), activation=act,
                  routing=Routing(normalize=bool(c.get("norm_topk_prob", True))))
        if mt == "qwen3_5_moe_text":
            ffn = lambda i: moe  # noqa: E731
        else:
            step, dense_only = get("decoder_sparse_step"), set(c.get("mlp_only_layers") or [])
            use_moe = lambda i: n_exp > 0 and i not in dense_only and (i + 1) % step == 0  # noqa: E731
            dense = MLP(c.positive("intermediate_size"), activation=act) if not all(map(use_moe, range(n))) else None
            ffn = lambda i: moe if use_moe(i) else dense  # noqa: E731
    layers = [Layer(attn if t == "full_attention" else gdn, ffn(i), norm_params=2 * hidden)
              for i, t in enumerate(types)]
    notes = ["the Gated DeltaNet state is counted in the state format; transformers keeps its recurrent part in "
             "fp32 (the conv part in the model's dtype): --state fp32 counts both parts in fp32"]
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", False)), final_norm=hidden, hidden=hidden,
                    notes=notes)
    return replace(spec, norm="rms1p", norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def spec_from_config(data: Any, name: str = "model", where: str = "config.json") -> ModelSpec:
    """Parse a config.json dict into a ModelSpec (raises KvwallError with a one-line reason)."""
    return validate.checked(data, where, lambda: _parse(Config(data, where), name))


def _parse(c: Config, name: str) -> ModelSpec:
    from kvwall.spec.families import family, supported

    data, where = c.data, c.where
    model_type = data.get("model_type")
    if model_type is None and "d_model" in data and "n_layer" in data:
        model_type = "mamba_ssm"
    if model_type is None:
        raise KvwallError(f"{where} has no 'model_type'; supported: {', '.join(supported())}")
    fam = family(model_type)
    if fam is None:
        raise KvwallError(f"model_type {model_type!r} in {where} is not supported; supported: "
                          f"{', '.join(supported())}")
    try:
        spec = fam.parse(c, name)
    except (TypeError, ValueError, AttributeError, KeyError, ArithmeticError) as exc:  # a field of the wrong type
        raise KvwallError(f"{where}: a field has an unexpected type or value ({exc}); check the config") from None
    native = checkpoint_weights(data.get("quantization_config"), spec.dtype)  # the checkpoint's own format
    return spec if native is None else replace(spec, weight_format=native)
