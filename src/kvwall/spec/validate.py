"""One validation pass over a config.json: every field the parsers read, checked once, in one place.

Two stages, both one-line errors naming the file, the field, the value and the fix:

* ``check_raw`` runs on the raw dict *before* any parser: types (a string or a bool where a number
  belongs), whole numbers, positivity, upper bounds. It must come first because some bad values
  hang or crash the parsers (50,000,000 layers builds a 50,000,000-entry list; ``n_groups: 0`` divides
  by zero) and because ``0`` would be read as "absent" by ``x or default``.
* ``check_spec`` runs on the parsed ModelSpec: rules between fields that the parsers derive
  (query heads a multiple of KV heads, top-k <= experts, Mamba-2 heads a multiple of groups, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvwall.errors import KvwallError
from kvwall.spec.model import ModelSpec, Rope

MAX_LAYERS = 100_000
MAX_DIM = 2**40  # far above any real width, vocabulary or context; keeps every product finite and fast

# Whole-number fields, by the smallest value they may take. Layer counts have their own, lower, ceiling.
_MIN_ONE = (
    "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
    "num_key_value_heads", "num_heads_kv", "head_dim", "attention_head_dim", "headdim", "intermediate_size",
    "n_inner", "vocab_size", "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "state_size", "ssm_state_size", "d_state", "mamba_d_state", "conv_kernel", "d_conv",
    "mamba_d_conv", "num_heads", "mamba_num_heads", "mamba_head_dim", "n_groups", "ngroups", "n_group",
    "topk_group", "expand", "mamba_expand", "attn_layer_period", "expert_layer_period", "decoder_sparse_step",
    "moe_layer_freq", "sliding_window", "sliding_window_pattern", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "n_positions",
    "original_max_position_embeddings", "pad_vocab_size_multiple", "patch_size", "image_size", "num_channels",
    "mamba_d_ssm", "mamba_n_heads", "mamba_n_groups", "conv_L_cache", "block_ff_dim", "block_multiple_of",
    "short_conv_kernel_size", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "num_expert_group",
    "num_experts_per_token", "model_max_length", "block_size",
    "intermediate_size_mlp", "interleave_moe_layer_step", "attention_chunk_size", "no_rope_layer_interval",
    "vision_output_dim", "projector_input_dim", "projector_output_dim",
)
_MIN_ZERO = (
    "attn_layer_offset", "expert_layer_offset", "first_k_dense_replace", "n_shared_experts", "max_window_layers",
    "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "d_intermediate",
    "num_nextn_predict_layers", "num_shared_experts", "shared_intermediate_size",
)
_TOKEN_IDS = ("bos_token_id", "pad_token_id")  # -1 is some configs' spelling of "none"
_AUTO_OR_MIN_ONE = ("time_step_rank", "mamba_dt_rank", "dt_rank", "mamba_d_head")  # "auto" or a whole number
_LAYER_COUNTS = ("num_hidden_layers", "n_layer")
# Real-valued fields: finite, and > 0 or >= 0.
_POSITIVE_REAL = ("rope_theta", "rope_local_base_freq", "factor", "routed_scaling_factor", "partial_rotary_factor",
                  "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "query_pre_attn_scalar",
                  "block_ffn_dim_multiplier")
_NON_NEGATIVE_REAL = ("rms_norm_eps", "layer_norm_epsilon", "mixer_rms_eps", "attn_logit_softcapping",
                      "final_logit_softcapping", "mscale", "mscale_all_dim", "time_step_min")
_STRINGS = ("model_type", "hidden_act", "hidden_activation", "activation_function", "mlp_hidden_act",
            "hybrid_override_pattern", "rope_type", "type", "topk_method", "torch_dtype", "dtype")
_INT_LISTS = ("mlp_only_layers", "attn_layer_idx", "full_attn_idxs", "kda_layers", "full_attn_layers",
              "attn_type_list", "moe_layers", "no_rope_layers")
_STRING_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types")
_NESTED = ("text_config", "vision_config", "ssm_cfg", "attn_cfg", "rope_scaling", "rope_parameters",
           "linear_attn_config")


def checked(data: Any, where: str, parse: Callable[[], ModelSpec]) -> ModelSpec:
    """Validate the raw config, parse it with `parse`, validate the result."""
    if not isinstance(data, dict):
        raise KvwallError(f"{where} is not a JSON object; a Hugging Face config.json is")
    check_raw(data, where)
    spec = parse()
    check_spec(spec, where)
    return spec


# -- the raw dict ---------------------------------------------------------------------------

def check_raw(data: dict, where: str, depth: int = 0) -> None:
    """Every known field of `data` (and of its nested sections) has a sane type and value."""
    for key, value in data.items():
        if value is None:
            continue  # an absent field: the parser's default or its "missing field" error applies
        if key == "sliding_window" and value == 0 and data.get("use_sliding_window") is False:
            continue  # transformers 5.25's Qwen2-MoE saves 0 for "no window" (configuration_qwen2_moe.py)
        if key in ("num_local_experts", "num_experts_per_tok") and value == 0 and \
                data.get("model_type") == "granitemoehybrid":
            continue  # Granite-4.0-H-1B's config.json: 0 experts = the shared MLP alone (a dense model)
        problem = _field_problem(key, value)
        if problem:
            raise KvwallError(f"{where}: {key!r} is {_show(value)}; {problem}; fix the config")
        if key in _NESTED and depth < 2:
            if not isinstance(value, dict):
                raise KvwallError(f"{where}: {key!r} is {_show(value)}; it must be a JSON object; fix the config")
            check_raw(value, f"{where} {key}", depth + 1)
    _check_derived_head_dim(data, where)


def _field_problem(key: str, value: Any) -> str | None:
    """What is wrong with one field's value (None: nothing, or a field this pass does not know)."""
    if key in _LAYER_COUNTS:
        return _whole_problem(value, 1, MAX_LAYERS)
    if key in _MIN_ONE:
        return _whole_problem(value, 1, MAX_DIM)
    if key in _MIN_ZERO:
        return _whole_problem(value, 0, MAX_DIM)
    if key in _TOKEN_IDS:
        return _whole_problem(value, -1, MAX_DIM)
    if key in _AUTO_OR_MIN_ONE:
        return None if value == "auto" else _whole_problem(value, 1, MAX_DIM)
    if key in _POSITIVE_REAL or key in _NON_NEGATIVE_REAL:
        return real_problem(value, above_zero=key in _POSITIVE_REAL)
    if key in _STRINGS and not isinstance(value, str):
        return "it must be a string"
    if key in _INT_LISTS and not _is_list_of(value, _is_int):
        return "it must be a list of whole numbers"
    if key in _STRING_LISTS and not _is_list_of(value, lambda x: isinstance(x, str)):
        return "it must be a list of strings"
    if key in _STRING_LISTS or key == "hybrid_override_pattern":
        return None if len(value) <= MAX_LAYERS else f"it has {len(value):,} entries; at most {MAX_LAYERS:,} layers"
    if key == "eos_token_id":
        ok = _is_int(value) and value >= -1 or _is_list_of(value, lambda x: _is_int(x) and x >= 0)
        return None if ok else "it must be a token id (a whole number >= 0, or -1 for none) or a list of them"
    if key in ("time_step_limit", "mamba_dt_limit"):
        return _range_problem(value)
    return None


def json_float(x: Any) -> float:
    """A number, or transformers' spelling of one JSON cannot hold: {"__float__": "Infinity"}."""
    return float(x["__float__"]) if isinstance(x, dict) else float(x)


def _range_problem(value: Any) -> str | None:
    """[lo, hi] with 0 <= lo <= hi (json_float's numbers: hi may be infinite; NaN fails the comparison)."""
    bad = "it must be a list of two numbers [low, high] with 0 <= low <= high"
    if not isinstance(value, list) or len(value) != 2:
        return bad
    try:
        lo, hi = map(json_float, value)
    except (KeyError, TypeError, ValueError):
        return bad
    return None if 0 <= lo <= hi else bad


def _whole_problem(value: Any, lo: int, hi: int) -> str | None:
    if not _is_int(value):
        return f"it must be a whole number from {lo} to {hi:,}"
    if not lo <= value <= hi:
        return f"it must be from {lo} to {hi:,}"
    return None


def real_problem(value: Any, above_zero: bool) -> str | None:
    """What is wrong with a real-valued figure (None: a finite number, > 0 or >= 0 as asked)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _fits_a_float(value)
    if ok and (value > 0 or (value == 0 and not above_zero)):
        return None
    return "it must be a finite number above 0" if above_zero else "it must be a finite number, 0 or above"


def _fits_a_float(value: int | float) -> bool:
    """Finite as a float: math.isfinite raises on an int past 1.8e308 (JSON allows rope_theta = 10**400)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_list_of(value: Any, pred: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(pred(x) for x in value)


def _show(value: Any) -> str:
    """The value as the user wrote it, cut short: a 4000-digit number or a long list stays one line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_derived_head_dim(data: dict, where: str) -> None:
    """Where the head width is hidden / heads (no head_dim field), the heads must divide the width."""
    for hidden_key, heads_key in (("hidden_size", "num_attention_heads"), ("n_embd", "n_head")):
        hidden, heads = data.get(hidden_key), data.get(heads_key)
        explicit = data.get("head_dim") or data.get("attention_head_dim") or data.get("kv_lora_rank")  # MLA: no split
        if _is_int(hidden) and _is_int(heads) and heads > 0 and not explicit and hidden % heads:
            raise KvwallError(f"{where}: {hidden_key!r} {hidden} is not a multiple of {heads_key!r} {heads}, and "
                              "there is no 'head_dim' to say the head width; fix one of them or add head_dim")


# -- the parsed spec ------------------------------------------------------------------------

def check_spec(spec: ModelSpec, where: str) -> None:
    """Rules between fields, on what the parsers built (each distinct mixer and FFN checked once)."""
    if not 1 <= spec.n_layers <= MAX_LAYERS:
        raise KvwallError(f"{where}: the model has {spec.n_layers:,} layers; it must have 1 to {MAX_LAYERS:,}")
    _positive(where, {"hidden size": spec.hidden, "vocab size": spec.vocab})
    seen: set[int] = set()
    for layer in spec.layers:
        for part in (layer.mixer, layer.ffn):
            if part is not None and id(part) not in seen:
                seen.add(id(part))
                _check_part(part, where)


def _check_part(part: Any, where: str) -> None:
    """Each mixer dataclass names its sizes and the rules between its fields (spec/model.py)."""
    _positive(where, part.sizes())
    for problem in part.problems():
        raise KvwallError(f"{where}: {problem}")
    _check_rope(getattr(part, "rope", None), where)


def _check_rope(rope: Rope | None, where: str) -> None:
    if rope is None:
        return
    for label, value in (("rope_theta", rope.theta), ("rope scaling factor", rope.factor),
                         ("partial_rotary_factor", rope.partial)):
        if not (math.isfinite(value) and value > 0):
            raise KvwallError(f"{where}: {label} is {value!r}; it must be a finite number above 0; fix the config")


def _positive(where: str, fields: dict[str, Any]) -> None:
    for label, value in fields.items():
        if not _is_int(value) or not 1 <= value <= MAX_DIM:
            raise KvwallError(f"{where}: {label} is {_show(value)}; it must be a whole number from 1 to "
                              f"{MAX_DIM:,}; fix the config")
