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
    KimiDeltaAttention,
    LatentAttention,
    Layer,
    LightningAttention,
    Mamba,
    Mamba2,
    ModelSpec,
    MoE,
    ParallelHybrid,
    Rope,
    Routing,
    ShortConv,
    SparseLatentAttention,
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
    act = _activation(c, "hidden_act")
    gdn = GatedDeltaNet(get("linear_num_key_heads"), get("linear_num_value_heads"), get("linear_key_head_dim"),
                        get("linear_value_head_dim"), get("linear_conv_kernel_dim"), interleaved=mt == "qwen3_next",
                        activation=act)
    if mt == "qwen3_5_text":
        dense = MLP(c.positive("intermediate_size"), activation=act)
        ffn = lambda i: dense  # noqa: E731
    else:
        n_exp, shared = get("num_experts"), get("shared_expert_intermediate_size")
        moe = MoE(n_exp, get("num_experts_per_tok"), get("moe_intermediate_size"), n_shared=1 if shared else 0,
                  d_shared=shared, shared_gate=bool(shared), activation=act,
                  # Qwen3.5-MoE's router always renormalises its top-k (modeling_qwen3_5_moe.py: no norm_topk_prob)
                  routing=Routing(normalize=mt == "qwen3_5_moe_text" or bool(c.get("norm_topk_prob", True))))
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



# transformers 5.25's Qwen3_5TextConfig / Qwen3_5MoeTextConfig class defaults for the fields parse_qwen3_next needs
# but a text_config may leave out (the linear_* and MoE defaults are _QWEN_LINEAR_* above)
_QWEN3_5_TEXT_DEFAULTS = {
    "qwen3_5_text": {"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                     "num_attention_heads": 16, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "qwen3_5_moe_text": {"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                         "max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
}
# transformers 5.25's Qwen3_5VisionConfig (= Qwen3_5MoeVisionConfig) class defaults; its attribute_map reads
# num_attention_heads as num_heads and num_hidden_layers as depth
_QWEN3_5_VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                            "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                            "out_hidden_size": 3584, "num_position_embeddings": 2304}


def parse_qwen3_5(c: Config, name: str) -> ModelSpec:
    """Multimodal Qwen3.5 (qwen3_5, qwen3_5_moe: the checkpoints as released): the language model is text_config,
    read over Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults by parse_qwen3_next; the vision tower and its patch
    merger are extra_params (what a deployment loads; they keep no cache). The wrapper's tie_word_embeddings (default
    false) decides whether lm_head is tied, as Qwen3_5ForConditionalGeneration does; text_config's own flag is not
    read there."""
    mt = c.req("model_type")
    text_type = f"{mt}_text"  # the sub-config class transformers builds text_config with, whatever it says
    text = dict(_QWEN3_5_TEXT_DEFAULTS[text_type])
    raw = c.get("text_config") or {}
    if not isinstance(raw, dict):
        raise KvwallError(f"{c.where}: text_config is {type(raw).__name__}; it must be an object of the language "
                          "model's fields")
    text.update({k: v for k, v in raw.items() if v is not None})
    text["model_type"] = text_type
    text["tie_word_embeddings"] = bool(c.get("tie_word_embeddings", False))
    if _dtype(c) and not _dtype(Config(text, "")):
        text["torch_dtype"] = _dtype(c)
    spec = parse_qwen3_next(Config(text, c.where + " text_config"), name)
    vision = c.get("vision_config") or {}
    if not isinstance(vision, dict):
        raise KvwallError(f"{c.where}: vision_config is {type(vision).__name__}; it must be an object of the vision "
                          "tower's fields")
    v = _aliased(Config(dict(vision), c.where + " vision_config"),
                 {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"})
    extra = qwen3_5_vision_params(_with_defaults(v, _QWEN3_5_VISION_DEFAULTS))
    notes = (f"includes the vision tower and patch merger ({extra:,} parameters; loaded, no cache); the "
             "multi-token-prediction (mtp.*) weights of the checkpoint are not loaded by transformers and not counted",)
    return replace(spec, model_type=mt, extra_params=extra, notes=spec.notes + notes)


def qwen3_5_vision_params(v: Config) -> int:
    """Qwen3.5's vision tower (Qwen3_5VisionModel, parameter count only): a Conv3d patch embedding with bias
    (in_channels x temporal_patch_size x patch_size^2 -> hidden), a learned position table (num_position_embeddings x
    hidden), depth blocks (two LayerNorms, a fused qkv and a proj with biases, a biased fc1/fc2 MLP), and the patch
    merger: a LayerNorm of hidden, then fc1 (hidden x spatial_merge_size^2, square, biased) and fc2 to
    out_hidden_size (biased). The rotary embedding has no parameters."""
    d, ff, depth = v.positive("hidden_size"), v.positive("intermediate_size"), v.positive("depth")
    heads = v.positive("num_heads")
    if d % heads:
        raise KvwallError(f"{v.where}: hidden_size {d} is not a multiple of num_heads {heads}; fix one of them")
    patch, t_patch = v.positive("patch_size"), v.positive("temporal_patch_size")
    embed = v.positive("in_channels") * t_patch * patch * patch * d + d + v.positive("num_position_embeddings") * d
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)
    merged = d * v.positive("spatial_merge_size") ** 2
    out = v.positive("out_hidden_size")
    merger = 2 * d + (merged * merged + merged) + (merged * out + out)
    return embed + depth * block + merger

# transformers 5.25's FalconH1Config class defaults, used where a config.json leaves a field out (as it does)
_FALCON_H1_DEFAULTS = {"num_key_value_heads": 8, "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": "auto",
                       "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
                       "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_rms_norm": False,
                       "projectors_bias": False, "attention_bias": False, "mlp_bias": False,
                       "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "mamba_norm_before_gate": True}
EXPECTED_UNMEASURED = ("expected mode: kvwall has no published measurement of {what}; its state traffic is timed "
                       "at the fraction of bandwidth fitted to weight streaming")


def parse_falcon_h1(c: Config, name: str) -> ModelSpec:
    """Falcon-H1: every layer runs GQA attention and Mamba-2 in parallel on the same normed input (outputs summed),
    then a gated MLP. transformers 5.25 gives every layer both (layers_block_type is "hybrid" throughout).

    Mamba-2 width: mamba_d_ssm (default 1024), or mamba_expand x hidden_size where mamba_d_ssm is null;
    mamba_d_head "auto" is that width / mamba_n_heads. in_proj carries a bias with mamba_proj_bias, out_proj with
    projectors_bias; the gated RMSNorm exists only with mamba_rms_norm. Attention head_dim: head_dim, else
    hidden_size / num_attention_heads. The muP multipliers (embedding, lm_head, key, attention/ssm in/out, mlp,
    ssm) scale activations only: engine details that change no bytes.
    """
    get = lambda key: c.data[key] if key in c.data else _FALCON_H1_DEFAULTS[key]  # noqa: E731  (null stays null)
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    types = c.get("layers_block_type", c.get("layer_types"))
    if types is not None and (not isinstance(types, list) or len(types) != n or set(types) != {"hybrid"}):
        raise KvwallError(f"{c.where}: layers_block_type is {types!r}; transformers 5.25's Falcon-H1 runs attention "
                          "and Mamba-2 in every layer (\"hybrid\" for each): remove the field")
    n_q = c.positive("num_attention_heads")
    n_kv = get("num_key_value_heads") or n_q  # null: one KV head per query head, as transformers does
    hd = c.get("head_dim") or hidden // n_q
    bias = bool(get("attention_bias"))
    # key_multiplier scales k before the rotation (linear): the same scores as a softmax scale of m / sqrt(head_dim)
    key_mult = float(c.get("key_multiplier", 1.0))
    attn = Attention(n_q, n_kv, hd, hd, None, bias, bias, rope=_rope(c),
                     scale=None if key_mult == 1.0 else key_mult * hd ** -0.5)
    d_ssm = get("mamba_d_ssm")
    d_ssm = int(get("mamba_expand") * hidden) if d_ssm is None else d_ssm
    heads, d_head = get("mamba_n_heads"), get("mamba_d_head")
    if d_head == "auto" and isinstance(heads, int) and heads > 0:
        d_head = d_ssm // heads
    if not isinstance(d_head, int) or isinstance(d_head, bool) or d_head * heads != d_ssm:
        raise KvwallError(f"{c.where}: mamba_d_head {d_head!r} x mamba_n_heads {heads} is not the Mamba-2 width "
                          f"{d_ssm} (mamba_d_ssm, else mamba_expand x hidden_size); fix one of them")
    mamba = Mamba2(heads, d_head, get("mamba_d_state"), get("mamba_n_groups"), get("mamba_d_conv"),
                   bool(get("mamba_conv_bias")), bool(get("mamba_proj_bias")), out_bias=bool(get("projectors_bias")),
                   gated_norm=bool(get("mamba_rms_norm")), dt_limit=_dt_limit(c),
                   norm_before_gate=bool(get("mamba_norm_before_gate")),
                   in_scales=_falcon_h1_scales(c, "ssm_multipliers", 5))
    mlp = MLP(c.positive("intermediate_size"), bias=bool(get("mlp_bias")), activation=_activation(c, "hidden_act"),
              multipliers=_falcon_h1_scales(c, "mlp_multipliers", 2) or (1.0, 1.0))
    mult = lambda key: float(c.get(key, 1.0))  # noqa: E731  (FalconH1Config's defaults: 1.0 each)
    hybrid = ParallelHybrid(attn, mamba, attention_in=mult("attention_in_multiplier"),
                            attention_out=mult("attention_out_multiplier"), ssm_in=mult("ssm_in_multiplier"),
                            ssm_out=mult("ssm_out_multiplier"))
    layer = Layer(hybrid, mlp, norm_params=2 * hidden)  # input_layernorm, pre_ff_layernorm
    notes = [EXPECTED_UNMEASURED.format(what="a parallel attention + Mamba-2 layer"),
             "the muP multipliers of Falcon-H1 scale activations only; they change no bytes"]
    spec = _decoder(c, name, [layer] * n, tied=bool(get("tie_word_embeddings")), final_norm=hidden, hidden=hidden,
                    notes=notes)
    return replace(spec, norm_eps=float(get("rms_norm_eps")), embed_scale=float(c.get("embedding_multiplier", 1.0)),
                   logit_scale=float(c.get("lm_head_multiplier", 1.0)))


def _falcon_h1_scales(c: Config, key: str, n: int) -> tuple[float, ...] | None:
    """Falcon-H1's list of n multipliers (engine-only), None when absent or all 1.0 (FalconH1Config's default)."""
    got = c.get(key)
    if got is None:
        return None
    if not isinstance(got, list) or len(got) != n or not all(isinstance(v, (int, float)) for v in got):
        raise KvwallError(f"{c.where}: {key} is {got!r}; Falcon-H1 takes a list of {n} numbers")
    return None if all(v == 1 for v in got) else tuple(float(v) for v in got)


def parse_lfm2(c: Config, name: str) -> ModelSpec:
    """LFM2: short-convolution ("conv") layers beside GQA attention layers (q/k RMSNorm), each with a gated MLP.

    layer_types names each layer; without it, the layers in full_attn_idxs are attention (all of them where that
    is absent too, as transformers 5.25 derives it). block_ff_dim replaces intermediate_size, tie_embedding
    tie_word_embeddings; with block_auto_adjust_ff_dim (default true) the MLP width is int(2 x d_ff / 3), times
    block_ffn_dim_multiplier, rounded up to block_multiple_of (transformers' Lfm2MLP): 12,288 -> 8,192.
    """
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    types = c.get("layer_types")
    if types is None:
        idxs = c.get("full_attn_idxs", list(range(n)))
        past = sorted({i for i in idxs if not 0 <= i < n}) if isinstance(idxs, list) else []
        if past:
            raise KvwallError(f"{c.where}: full_attn_idxs has {past}, past the model's {n} layers (0 to {n - 1}); "
                              "fix full_attn_idxs or num_hidden_layers")
        types = ["full_attention" if i in idxs else "conv" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise KvwallError(f"{c.where}: layer_types must list one type per layer ({n}, num_hidden_layers)")
    unknown = sorted({str(t) for t in types if t not in ("conv", "full_attention")})
    if unknown:
        raise KvwallError(f"{c.where}: layer_types has {unknown}; known are conv, full_attention")
    n_q = c.positive("num_attention_heads")
    hd = c.get("head_dim") or hidden // n_q
    rope = _rope(c)
    if c.get("rope_theta") is None and not c.get("rope_parameters"):
        rope = replace(rope, theta=1_000_000.0)  # Lfm2Config.default_theta
    attn = Attention(n_q, c.get("num_key_value_heads", 8), hd, hd, qk_norm=True, rope=rope)
    conv = ShortConv(hidden, c.get("conv_L_cache", 3), bool(c.get("conv_bias", False)))
    d_ff = c.data["block_ff_dim"] if "block_ff_dim" in c.data else c.get("intermediate_size", 12288)
    if c.get("block_auto_adjust_ff_dim", True):
        d_ff = int(2 * d_ff / 3)
        mult = c.data.get("block_ffn_dim_multiplier", 1.0)
        if mult is None:  # Lfm2MLP would skip the multiplier and the rounding, but 5.25's config class refuses null
            raise KvwallError(f"{c.where}: block_ffn_dim_multiplier is null; transformers 5.25 needs a number "
                              "(1.0: none)")
        step = c.get("block_multiple_of", 256)
        d_ff = step * ((int(mult * d_ff) + step - 1) // step)
    mlp = MLP(d_ff)
    layers = [Layer(attn if t == "full_attention" else conv, mlp, norm_params=2 * hidden) for t in types]
    tied = c.data["tie_embedding"] if "tie_embedding" in c.data else c.get("tie_word_embeddings", True)
    notes = [EXPECTED_UNMEASURED.format(what="a short-convolution layer")] if "conv" in types else []
    spec = _decoder(c, name, layers, tied=bool(tied), final_norm=hidden, hidden=hidden, notes=notes)  # embedding_norm
    return replace(spec, norm_eps=float(c.get("norm_eps", 1e-5)))


# transformers 5.25's GptOssConfig class defaults (configuration_gpt_oss.py), used where a config.json leaves a field
# out, as transformers does; its rope default is YaRN x32 over 4,096 positions, theta 150,000
_GPT_OSS_DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4, "attention_bias": True,
}
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def _with_defaults(c: Config, defaults: dict) -> Config:
    """The config over the class defaults: a field the file leaves out takes the default (one it sets to null
    stays null, as transformers keeps it)."""
    return Config(defaults | c.data, c.where)


def _kv_heads(c: Config, n_q: int) -> int:
    """num_key_value_heads; null means one per query head (MHA), as the config classes' __post_init__ sets it."""
    n_kv = c.data.get("num_key_value_heads")
    return n_q if n_kv is None else c.positive("num_key_value_heads")


def parse_gpt_oss(c: Config, name: str) -> ModelSpec:
    """gpt-oss: GQA with q/k/v/o biases and a learned sink logit per query head, sliding (sliding_window, 128) and
    full layers as layer_types says (transformers' default: even layers sliding, odd ones full), and a MoE in every
    layer: a biased router picks num_experts_per_tok of num_local_experts experts, each a gated MLP of
    intermediate_size with biases on gate_up and down (a clamped SwiGLU: alpha 1.702, limit swiglu_limit)."""
    if c.data.get("num_local_experts") is None and c.data.get("num_experts") is not None:  # attribute_map
        c = Config(dict(c.data, num_local_experts=c.data["num_experts"]), c.where)
    c = _with_defaults(c, _GPT_OSS_DEFAULTS)
    if c.get("rope_parameters") is None and c.get("rope_scaling") is None:
        c = Config(dict(c.data, rope_parameters=dict(_GPT_OSS_ROPE, rope_theta=c.get("rope_theta", 150000.0))),
                   c.where)
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    n_q = c.positive("num_attention_heads")
    n_kv = _kv_heads(c, n_q)
    hd = c.positive("head_dim") if c.data.get("head_dim") is not None else hidden // n_q
    if n_q % n_kv:
        raise KvwallError(f"{c.where}: num_attention_heads {n_q} is not a multiple of num_key_value_heads {n_kv}")
    bias = bool(c.get("attention_bias"))
    if c.get("layer_types") is None:  # transformers: sliding when (i + 1) % 2 (even layers), whatever the window
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        c = Config(dict(c.data, layer_types=types), c.where)
    windows = _windows(c, n, None)  # a sliding layer without a sliding_window is an error (transformers fails too)
    rope = _rope(c)
    moe = MoE(c.positive("num_local_experts"), c.positive("num_experts_per_tok"), c.positive("intermediate_size"),
              bias=True, activation="clamped_swiglu", routing=Routing(normalize=True),  # softmax over the top-k logits
              swiglu=(float(c.get("swiglu_alpha", 1.702)), float(c.get("swiglu_limit", 7.0))))
    layers = [Layer(Attention(n_q, n_kv, hd, hd, w, bias, bias, sinks=True, rope=rope), moe, norm_params=2 * hidden)
              for w in windows]
    notes = [f"attention sinks: one learned logit per query head ({n_q} parameters a layer), no cache bytes",
             "expected mode: sinks and windows timed as plain attention over the tokens read, MXFP4 experts as "
             "weights in their format; held against 10 published llama.cpp gpt-oss rows (DGX Spark, 0-32k)"]
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings")), final_norm=hidden, hidden=hidden,
                    notes=notes)
    return replace(spec, norm_eps=float(c.get("rms_norm_eps")))


# transformers 5.25's Llama4TextConfig class defaults (configuration_llama4.py)
_LLAMA4_TEXT_DEFAULTS = {
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "num_experts_per_tok": 1, "num_local_experts": 16, "interleave_moe_layer_step": 1,
    "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "attention_bias": False,
    "rope_theta": 500000.0,
}


def _positive_int(c: Config, key: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KvwallError(f"{c.where}: {key!r} is {value!r}; it must be a positive integer")
    return value


def _llama4_layout(c: Config, n: int) -> tuple[list[bool], list[bool], list[bool]]:
    """(RoPE, chunked, MoE) per layer, derived as Llama4TextConfig.__post_init__ does: no_rope_layers (1 = RoPE),
    when empty every no_rope_layer_interval-th layer (i + 1) % interval == 0 is NoPE; moe_layers, when unset every
    interleave_moe_layer_step-th layer from step - 1; layer_types, when unset chunked_attention on the RoPE layers
    (if attention_chunk_size is set) and full_attention on the NoPE ones."""
    flags = c.get("no_rope_layers") or []
    if not flags:
        interval = _positive_int(c, "no_rope_layer_interval", c.get("no_rope_layer_interval"))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) for f in flags):
        raise KvwallError(f"{c.where}: no_rope_layers must list a 0 (NoPE) or 1 (RoPE) for each of the {n} layers")
    rope = [bool(f) for f in flags[:n]]
    chunk = c.get("attention_chunk_size")
    types = c.data.get("layer_types")
    if types is None:
        types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    if not isinstance(types, list) or len(types) != n:
        raise KvwallError(f"{c.where}: layer_types must list one type per layer ({n}, num_hidden_layers)")
    unknown = sorted({str(t) for t in types if t not in ("chunked_attention", "full_attention")})
    if unknown:
        raise KvwallError(f"{c.where}: layer_types has {unknown}; known are chunked_attention, full_attention")
    if "chunked_attention" in types:
        _positive_int(c, "attention_chunk_size", chunk)
    moe_layers = c.data.get("moe_layers")
    if moe_layers is None:
        step = _positive_int(c, "interleave_moe_layer_step", c.get("interleave_moe_layer_step"))
        moe_layers = list(range(step - 1, n, step))
    if not isinstance(moe_layers, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n
                                               for i in moe_layers):
        raise KvwallError(f"{c.where}: moe_layers must list layer indices from 0 to {n - 1}")
    return rope, [t == "chunked_attention" for t in types], [i in set(moe_layers) for i in range(n)]


def parse_llama4_text(c: Config, name: str) -> ModelSpec:
    """Llama 4 text: GQA on every layer; chunked local attention (attention_chunk_size) with RoPE and a weightless
    q/k RMS norm (use_qk_norm) on most layers, global NoPE full attention on the others; MoE layers (a sigmoid
    router over top-k of num_local_experts experts of intermediate_size, plus one shared expert of the same width)
    where moe_layers says, dense MLPs of intermediate_size_mlp between them (Maverick)."""
    c = _with_defaults(c, _LLAMA4_TEXT_DEFAULTS)
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    n_q = c.positive("num_attention_heads")
    n_kv = _kv_heads(c, n_q)
    hd = c.positive("head_dim") if c.data.get("head_dim") is not None else hidden // n_q
    if n_q % n_kv:
        raise KvwallError(f"{c.where}: num_attention_heads {n_q} is not a multiple of num_key_value_heads {n_kv}")
    rope_on, chunked, moe_on = _llama4_layout(c, n)
    bias, qk = bool(c.get("attention_bias")), bool(c.get("use_qk_norm"))
    chunk, rope = c.get("attention_chunk_size"), replace(_rope(c), interleaved=True)  # complex pairs (x0, x1), ...
    act = _activation(c, "hidden_act")
    d_expert = c.positive("intermediate_size")
    moe = MoE(c.positive("num_local_experts"), c.positive("num_experts_per_tok"), d_expert, n_shared=1,
              d_shared=d_expert, activation=act, routing=Routing("sigmoid", normalize=False, on_input=True))  # top-k
    # transformers' Llama4TextAttention: temperature tuning on the NoPE layers (floor_scale 8192, attn_scale 0.1)
    tuning = (float(c.get("floor_scale", 8192)), float(c.get("attn_scale", 0.1))) \
        if c.get("attn_temperature_tuning", True) else None
    dense = MLP(c.positive("intermediate_size_mlp"), activation=act)
    layers = []
    for i in range(n):
        attn = Attention(n_q, n_kv, hd, hd, None, bias, bias, chunk=chunk if chunked[i] else None,
                         rope=rope if rope_on[i] else None, l2_qk_norm=qk and rope_on[i],
                         temperature=None if rope_on[i] else tuning)
        layers.append(Layer(attn, moe if moe_on[i] else dense, norm_params=2 * hidden))
    notes = []
    if any(chunked):
        notes.append(f"chunked layers (attention_chunk_size {chunk:,}): memory and fit reserve the worst case within "
                     f"a chunk, {chunk:,} tokens (transformers' cache holds the last {chunk - 1:,} after a long "
                     "prefill, plus the new token); a decode step reads only its current chunk's tokens")
    notes.append("expected mode: no published measurement of chunked attention; it is timed as plain attention over "
                 "the tokens a step reads")
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings")), final_norm=hidden, hidden=hidden,
                    notes=notes)
    return replace(spec, norm_eps=float(c.get("rms_norm_eps")))


# transformers 5.25's DeepseekV32Config class defaults (configuration_deepseek_v32.py), used where a config.json
# leaves a field out, as transformers does
_DEEPSEEK_V32_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    "first_k_dense_replace": 3,
}
_DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")  # the second: the name before transformers 5.25


def parse_deepseek_v32(c: Config, name: str) -> ModelSpec:
    """DeepSeek-V3.2: DeepSeek-V3's MLA + MoE stack (parse_deepseek) with DeepSeek Sparse Attention on every layer.

    As transformers 5.25 builds it: every layer is DSA (layer_types, when given, may only say so); the channel
    mixer follows mlp_layer_types ("dense" / "sparse"), else the first first_k_dense_replace layers are dense and
    the rest MoE (moe_layer_freq is not read); missing fields take DeepseekV32Config's defaults.
    """
    data = {k: v for k, v in _DEEPSEEK_V32_DEFAULTS.items() if k not in c.data} | c.data
    data["rope_interleave"] = True  # DeepseekV32Attention always rotates MLA's pairs (it reads no rope_interleave)
    c = Config(data, c.where)
    base = parse_deepseek(c, name)
    n = base.n_layers
    types = c.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n
                              or any(t not in _DSA_LAYER_TYPES for t in types)):
        raise KvwallError(f"{c.where}: layer_types must list one of {', '.join(_DSA_LAYER_TYPES)} per layer ({n}); "
                          "every deepseek_v32 layer is sparse attention")
    mlp_types = c.get("mlp_layer_types")
    if mlp_types is None:
        first = c.get("first_k_dense_replace")
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise KvwallError(f"{c.where}: first_k_dense_replace is {first!r}; it must be a whole number, 0 or above")
        mlp_types = ["dense"] * min(first, n) + ["sparse"] * (n - min(first, n))
    if not isinstance(mlp_types, list) or len(mlp_types) != n or any(t not in ("dense", "sparse") for t in mlp_types):
        raise KvwallError(f"{c.where}: mlp_layer_types must list dense or sparse for each of the {n} layers")
    dense = MLP(c.positive("intermediate_size"))
    moe = None
    if "sparse" in mlp_types:
        moe = MoE(c.positive("n_routed_experts"), c.positive("num_experts_per_tok"),
                  c.positive("moe_intermediate_size"), n_shared=c.get("n_shared_experts", 0),
                  routing=_deepseek_routing(c, False))
    dsa = SparseLatentAttention(base.layers[0].mixer, c.positive("index_n_heads"), c.positive("index_head_dim"),
                                c.positive("index_topk"))
    layers = tuple(replace(layer, mixer=dsa, ffn=moe if t == "sparse" else dense)
                   for layer, t in zip(base.layers, mlp_types))
    key = dsa.index_keys.vector_bytes(dsa.index_head_dim)
    notes = [f"the DSA indexer's key cache is counted as DeepSeek's inference code stores it, {dsa.index_keys.name}: "
             f"{key} B per token and layer, whatever --kv says (transformers 5.25 keeps it in the model's dtype: "
             f"{2 * dsa.index_head_dim} B in bf16)",
             "DeepSeek Sparse Attention: a decode step reads every indexer key but only the top "
             f"{dsa.index_topk:,} latents; expected mode has no published measurement of DSA (its fractions were "
             "fitted on dense attention and MLA runs), so its times for this model are an extrapolation"]
    return replace(base, layers=layers, notes=base.notes + tuple(notes))


# transformers 5.25's GraniteMoeHybridConfig class defaults (configuration_granitemoehybrid.py) for the fields
# that shape the hybrid, used where a config.json leaves them out, as transformers does
_GRANITE_HYBRID_DEFAULTS = {
    "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024, "mamba_n_heads": 128,
    "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_conv_bias": True, "mamba_proj_bias": False,
}
# layer_types names (transformers 5.25 renames mamba -> linear_attention, attention -> full_attention)
_GRANITE_BLOCKS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
                   "full_attention": "attention"}


def parse_granitemoehybrid(c: Config, name: str) -> ModelSpec:
    """Granite 4.0 hybrids: Mamba-2 or GQA attention per layer (layer_types; without it every layer is Mamba-2, as
    transformers derives it), each followed by a channel mixer: num_local_experts routed experts of
    intermediate_size (top num_experts_per_tok, softmax over the chosen logits) plus one shared gated MLP of
    shared_intermediate_size, always run; with num_local_experts 0 only that shared MLP. Attention: rotary only
    with position_embedding_type "rope" (Granite 4.0-H: none), biases on q/k/v/o with attention_bias, head_dim
    hidden_size / heads. The muP multipliers (embedding, residual, attention, logits) change no bytes: engine-only.
    """
    get = lambda key: c.get(key, _GRANITE_HYBRID_DEFAULTS[key])  # noqa: E731
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    types = c.get("layer_types", c.get("layers_block_type"))
    types = ["mamba"] * n if types is None else types
    if not isinstance(types, list) or len(types) != n:
        raise KvwallError(f"{c.where}: layer_types must list one type per layer ({n}, num_hidden_layers)")
    unknown = sorted({str(t) for t in types if t not in _GRANITE_BLOCKS})
    if unknown:
        raise KvwallError(f"{c.where}: layer_types has {unknown}; known are {', '.join(_GRANITE_BLOCKS)}")
    expand, n_heads = get("mamba_expand"), get("mamba_n_heads")
    d_inner = int(expand * hidden)
    head_dim = get("mamba_d_head")
    if head_dim == "auto":
        head_dim = d_inner // n_heads if isinstance(n_heads, int) and n_heads > 0 else n_heads
    mamba = Mamba2(n_heads, head_dim, get("mamba_d_state"), get("mamba_n_groups"), get("mamba_d_conv"),
                   bool(get("mamba_conv_bias")), bool(get("mamba_proj_bias")), dt_limit=_dt_limit(c))
    if "mamba" in map(_GRANITE_BLOCKS.get, types) and mamba.d_inner != d_inner:
        raise KvwallError(f"{c.where}: mamba_n_heads x mamba_d_head = {mamba.d_inner} but mamba_expand x hidden_size "
                          f"= {d_inner}; fix one of them")
    bias = bool(c.get("attention_bias", False))
    attn = _attention(c, hidden, qkv_bias=bias, o_bias=bias)
    rope = _rope(c) if c.get("position_embedding_type") == "rope" else None
    attn = replace(attn, rope=rope, scale=float(c.get("attention_multiplier", 1.0)))
    act = _activation(c, "hidden_act")
    shared, n_exp = get("shared_intermediate_size"), get("num_local_experts")
    if n_exp:
        ffn: Any = MoE(n_exp, get("num_experts_per_tok"), c.positive("intermediate_size"), n_shared=1 if shared else 0,
                       d_shared=shared, routing=Routing(normalize=True), activation=act)
    else:
        ffn = MLP(shared, activation=act)
    layers = [Layer(mamba if _GRANITE_BLOCKS[t] == "mamba" else attn, ffn, norm_params=2 * hidden) for t in types]
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings", False)), final_norm=hidden, hidden=hidden)
    # engine-only muP multipliers (GraniteMoeHybridConfig defaults 1.0 each): embeddings, both residual branches,
    # logits divided by logits_scaling
    return replace(spec, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   embed_scale=float(c.get("embedding_multiplier", 1.0)),
                   residual_scale=float(c.get("residual_multiplier", 1.0)),
                   logit_scale=1.0 / float(c.get("logits_scaling", 1.0)))


# transformers 5.25's Llama4VisionConfig class defaults (configuration_llama4.py)
_LLAMA4_VISION_DEFAULTS = {
    "hidden_size": 768, "num_hidden_layers": 34, "num_attention_heads": 16, "num_channels": 3,
    "intermediate_size": 5632, "vision_output_dim": 7680, "image_size": 448, "patch_size": 14,
    "projector_input_dim": 4096, "projector_output_dim": 4096,
}


def llama4_vision_params(v: Config, text_hidden: int) -> int:
    """Llama 4's vision tower, pixel-shuffle adapter and multimodal projector (parameter count only): an unfold
    patch embedding (no bias), class and position embeddings, pre/post LayerNorms, encoder layers (q/k/v/o with
    biases, a biased GELU MLP, two LayerNorms), the adapter's two bias-free matrices and the bias-free projector."""
    d, ff = v.positive("hidden_size"), v.positive("intermediate_size")
    patch, image, heads = v.positive("patch_size"), v.positive("image_size"), v.positive("num_attention_heads")
    qkv = heads * (d // heads)  # each of q, k and v: num_heads x head_dim (hidden // heads)
    embed = v.positive("num_channels") * patch * patch * d + d + ((image // patch) ** 2 + 1) * d + 2 * 2 * d
    layer = 3 * (d * qkv + qkv) + (qkv * d + d) + (d * ff + ff) + (ff * d + d) + 2 * 2 * d
    adapter = ff * v.positive("projector_input_dim") + v.positive("projector_output_dim") ** 2
    return embed + v.positive("num_hidden_layers") * layer + adapter + v.positive("vision_output_dim") * text_hidden


def parse_llama4(c: Config, name: str) -> ModelSpec:
    """Multimodal Llama 4 (Scout, Maverick as released): the language model is text_config (over Llama4TextConfig
    defaults), the vision tower's parameters are extra_params (what a deployment loads; no cache)."""
    text = dict(c.get("text_config") or {})
    text["model_type"] = "llama4_text"
    if _dtype(c) and not _dtype(Config(text, "")):
        text["torch_dtype"] = _dtype(c)
    spec = parse_llama4_text(Config(text, c.where + " text_config"), name)
    vision = _with_defaults(Config(dict(c.get("vision_config") or {}), c.where + " vision_config"),
                            _LLAMA4_VISION_DEFAULTS)
    extra = llama4_vision_params(vision, spec.hidden)
    notes = (f"includes the vision tower, adapter and projector ({extra:,} parameters)",)
    return replace(spec, model_type="llama4", extra_params=extra, notes=spec.notes + notes)


def _aliased(c: Config, aliases: dict[str, str]) -> Config:
    """A config whose attribute_map aliases (transformers: a saved name -> the attribute) are read under the
    attribute's name, as transformers' config object reads them. Both spelled, with different values: an error."""
    data = dict(c.data)
    for saved, attr in aliases.items():
        a, b = data.get(saved), data.get(attr)
        if a is not None and b is not None and a != b:
            raise KvwallError(f"{c.where}: {saved!r} is {a!r} but {attr!r} is {b!r}; they name the same field, keep "
                              "one")
        if a is not None:
            data[attr] = a
    return Config(data, c.where)


def _layer_types(c: Config, n: int, types: Any) -> list[str]:
    """A layer_types list of linear_attention / full_attention, one per layer, or a one-line error."""
    if not isinstance(types, list) or len(types) != n:
        raise KvwallError(f"{c.where}: layer_types must list one type per layer ({n}, num_hidden_layers)")
    unknown = sorted({str(t) for t in types if t not in ("linear_attention", "full_attention")})
    if unknown:
        raise KvwallError(f"{c.where}: layer_types has {unknown}; known are linear_attention, full_attention")
    return types


# transformers 5.25's KimiLinearConfig class defaults (configuration_kimi_linear.py), used where a config.json
# leaves a field out, as transformers does; first_k_dense_replace is read from the raw file (default 1)
_KIMI_DEFAULTS = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1,
    "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "pad_token_id": 163839, "bos_token_id": 163584,
    "eos_token_id": 163586, "tie_word_embeddings": False, "attention_bias": False, "num_local_experts": 256,
    "linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4, "first_k_dense_replace": 1,
}
# its attribute_map: the names a saved config.json uses -> transformers' attribute names
_KIMI_ALIASES = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
                 "num_expert_group": "n_group", "num_experts": "num_local_experts",
                 "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts"}
# linear_attn_config (the checkpoint's own sub-dict) -> the top-level field it overrides
_KIMI_LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                     "short_conv_kernel_size": "linear_conv_kernel_dim"}


def parse_kimi_linear(c: Config, name: str) -> ModelSpec:
    """Kimi Linear: Kimi Delta Attention ("linear_attention") layers beside MLA ("full_attention") layers, a dense
    MLP on the first first_k_dense_replace layers and a MoE (sigmoid router, one shared MLP of n_shared_experts x
    moe_intermediate_size) on the rest, as transformers 5.25's KimiLinearConfig reads them.

    Layer pattern: layer_types; else linear_attn_config's kda_layers and full_attn_layers (1-based, both needed);
    else layer i is full attention when i > 0 and i % 4 == 0. MLP pattern: mlp_layer_types ("dense"/"sparse");
    else first_k_dense_replace. The MLA layers have no rotary embedding (NoPE): the qk_rope_head_dim part of the key
    is cached as it comes out of kv_a_proj_with_mqa.
    """
    c = _with_defaults(_aliased(c, _KIMI_ALIASES), _KIMI_DEFAULTS)
    linear = c.get("linear_attn_config", {})
    if not isinstance(linear, dict):
        raise KvwallError(f"{c.where}: linear_attn_config must be a JSON object")
    for key in ("use_full_rank_gate", "mla_use_output_gate"):
        if linear.get(key) or c.get(key):  # Kimi-K3's; transformers 5.25 builds the low-rank gates only
            raise KvwallError(f"{c.where}: {key} is set, which transformers 5.25's kimi_linear does not build (it "
                              "has low-rank gates and no MLA output gate); kvwall cannot size it")
    if c.get("moe_layer_freq", 1) != 1:
        raise KvwallError(f"{c.where}: moe_layer_freq is {c.get('moe_layer_freq')!r}; transformers 5.25's "
                          "kimi_linear ignores it (every layer from first_k_dense_replace on is MoE); set it to 1")
    get = lambda key: linear.get(key, c.get(_KIMI_LINEAR_KEYS[key]))  # noqa: E731
    kda = KimiDeltaAttention(_positive_int(c, "linear_attn_config num_heads", get("num_heads")),
                             _positive_int(c, "linear_attn_config head_dim", get("head_dim")),
                             _positive_int(c, "linear_attn_config short_conv_kernel_size",
                                           get("short_conv_kernel_size")))
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    types = _kimi_layer_types(c, n, linear)
    q_lora = c.data.get("q_lora_rank")
    mla = LatentAttention(n_heads=c.positive("num_attention_heads"), kv_lora_rank=c.positive("kv_lora_rank"),
                          q_lora_rank=None if q_lora is None else c.positive("q_lora_rank"),
                          qk_nope_head_dim=c.positive("qk_nope_head_dim"),
                          qk_rope_head_dim=c.positive("qk_rope_head_dim"), v_head_dim=c.positive("v_head_dim"),
                          bias=bool(c.get("attention_bias")))  # rope None: NoPE
    mlp_types = c.get("mlp_layer_types")
    if mlp_types is None:
        first = c.get("first_k_dense_replace")
        mlp_types = ["dense" if i < first else "sparse" for i in range(n)]
    if not isinstance(mlp_types, list) or len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
        raise KvwallError(f"{c.where}: mlp_layer_types must list dense or sparse for each of the {n} layers")
    act = _activation(c, "hidden_act")
    dense = MLP(c.positive("intermediate_size"), activation=act) if "dense" in mlp_types else None
    shared = c.get("n_shared_experts")
    routing = Routing("sigmoid", bias=True, n_group=c.positive("n_group"), topk_group=c.positive("topk_group"),
                      group_score="top2", normalize=bool(c.get("norm_topk_prob")),
                      scale=float(c.get("routed_scaling_factor")))
    moe = MoE(c.positive("num_local_experts"), c.positive("num_experts_per_tok"), c.positive("moe_intermediate_size"),
              n_shared=1 if shared else 0, d_shared=c.positive("moe_intermediate_size") * shared, activation=act,
              routing=routing) if "sparse" in mlp_types else None
    layers = [Layer(mla if t == "full_attention" else kda, moe if f == "sparse" else dense, norm_params=2 * hidden)
              for t, f in zip(types, mlp_types)]
    notes = ["the KDA state is counted in the state format; transformers keeps its recurrent part in fp32 (the conv "
             "part in the model's dtype): --state fp32 counts both parts in fp32",
             "MLA layers without rotary positions (NoPE): the cache holds the latent and the unrotated shared key",
             EXPECTED_UNMEASURED.format(what="a Kimi Delta Attention layer")]
    if c.get("num_nextn_predict_layers"):
        notes.append(f"{c.get('num_nextn_predict_layers')} multi-token-prediction layer(s) not counted "
                     "(transformers does not load them)")
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings")), final_norm=hidden, hidden=hidden,
                    notes=notes)
    return replace(spec, norm_eps=float(c.get("rms_norm_eps")))


def _kimi_layer_types(c: Config, n: int, linear: dict) -> list[str]:
    """layer_types; else linear_attn_config's 1-based kda_layers / full_attn_layers; else every 4th from layer 4."""
    if c.get("layer_types") is not None:
        return _layer_types(c, n, c.get("layer_types"))
    kda, full = linear.get("kda_layers"), linear.get("full_attn_layers")
    if kda is None and full is None:
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if kda is None or full is None:  # transformers would fall back to the default pattern without a word
        raise KvwallError(f"{c.where}: linear_attn_config has {'kda_layers' if full is None else 'full_attn_layers'} "
                          "but not the other; the layer pattern needs both (1-based layer numbers); add it")
    types: list[str | None] = [None] * n
    for numbers, kind in ((full, "full_attention"), (kda, "linear_attention")):
        for k in numbers:
            if not 1 <= k <= n or types[k - 1] is not None:
                raise KvwallError(f"{c.where}: linear_attn_config lists layer {k} twice or outside 1..{n}; each "
                                  "layer must be in exactly one of kda_layers and full_attn_layers")
            types[k - 1] = kind
    missing = [i + 1 for i, t in enumerate(types) if t is None]
    if missing:
        raise KvwallError(f"{c.where}: linear_attn_config names no type for layer(s) {missing[:5]} (1-based); each "
                          "layer must be in kda_layers or full_attn_layers")
    return types


# transformers 5.25's MiniMaxConfig class defaults (configuration_minimax.py), used where a config.json leaves a
# field out, as transformers does (rope theta: its default_theta, 1,000,000)
_MINIMAX_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "num_experts_per_tok": 2, "num_local_experts": 8, "rope_theta": 1_000_000.0,
}


def parse_minimax(c: Config, name: str) -> ModelSpec:
    """MiniMax-01: lightning attention ("linear_attention") layers beside softmax GQA ("full_attention") layers, a
    MoE (softmax top-k of num_local_experts gated MLPs of intermediate_size, renormalised) in every layer.

    Layer pattern: layer_types; else the remote code's attn_type_list (0 lightning, 1 softmax: MiniMax's own
    checkpoints, which transformers 5.25 does not read); else transformers' default, layer i softmax when
    (i + 1) % 2 (even layers). Both attention kinds have num_attention_heads heads of head_dim (hidden /
    heads where absent); sliding_window, where set, windows the softmax layers.
    """
    c = _with_defaults(_aliased(c, {"num_experts": "num_local_experts"}), _MINIMAX_DEFAULTS)
    hidden = c.positive("hidden_size")
    n = c.positive("num_hidden_layers")
    n_q = c.positive("num_attention_heads")
    n_kv = _kv_heads(c, n_q)
    if n_q % n_kv:
        raise KvwallError(f"{c.where}: num_attention_heads {n_q} is not a multiple of num_key_value_heads {n_kv}")
    hd = c.positive("head_dim") if c.data.get("head_dim") is not None else hidden // n_q
    shared = c.get("shared_intermediate_size", 0)
    if any(shared) if isinstance(shared, list) else shared:  # the remote code's shared MLP (shared_moe)
        raise KvwallError(f"{c.where}: shared_intermediate_size is {shared!r}; transformers 5.25's minimax builds "
                          "no shared expert, so kvwall cannot size it; set it to 0")
    notes = ["the lightning-attention state is counted in the state format (transformers keeps it in the model's "
             "dtype)", EXPECTED_UNMEASURED.format(what="a lightning-attention layer")]
    types = c.get("layer_types")
    if types is None and c.get("attn_type_list") is not None:
        codes = c.get("attn_type_list")
        if len(codes) != n or set(codes) - {0, 1}:
            raise KvwallError(f"{c.where}: attn_type_list must hold 0 (lightning) or 1 (softmax) for each of the "
                              f"{n} layers")
        types = ["full_attention" if code else "linear_attention" for code in codes]
        notes.append("layer pattern from attn_type_list (MiniMax's remote-code field; transformers 5.25 reads only "
                     "layer_types)")
    elif types is None:
        types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)]
    types = _layer_types(c, n, types)
    window = c.get("sliding_window")
    if window:
        notes.append(f"sliding_window {window}: the softmax layers keep and read at most that many tokens "
                     "(transformers' MiniMaxCache keeps them all but masks to the window)")
    attn = Attention(n_q, n_kv, hd, hd, int(window) if window else None, rope=_rope(c))
    lightning = LightningAttention(n_q, hd)
    moe = MoE(c.positive("num_local_experts"), c.positive("num_experts_per_tok"), c.positive("intermediate_size"),
              activation=_activation(c, "hidden_act"), routing=Routing(normalize=True))
    # the residual factors (engine-only), in transformers' spelling or the remote code's (layernorm_mlp_alpha, ...)
    factor = lambda ours, remote: float(c.get(ours, c.get(f"layernorm_{remote}", 1)))  # noqa: E731
    factors = {t: (factor(f"{a}_alpha_factor", f"{t}_alpha"), factor(f"{a}_beta_factor", f"{t}_beta"),
                   factor("mlp_alpha_factor", "mlp_alpha"), factor("mlp_beta_factor", "mlp_beta"))
               for t, a in (("full_attention", "full_attn"), ("linear_attention", "linear_attn"))}
    layers = [Layer(attn if t == "full_attention" else lightning, moe, norm_params=2 * hidden,
                    alpha_beta=factors[t]) for t in types]
    spec = _decoder(c, name, layers, tied=bool(c.get("tie_word_embeddings")), final_norm=hidden, hidden=hidden,
                    notes=notes)
    return replace(spec, norm_eps=float(c.get("rms_norm_eps")))


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
