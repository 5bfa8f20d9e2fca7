"""kvwall's Python API: the predictor's commands as functions.

Each function takes keyword arguments named like the command line's options (``--kv-format fp8`` is
``kv_format="fp8"``, ``--prompt 2k`` is ``prompt_tokens="2k"``) and returns a frozen dataclass whose attributes
hold the main figures and whose ``to_dict()`` is exactly what ``kvwall <command> --json`` prints for the same
arguments. The commands call these functions: there is one implementation.

The arguments every function shares:

- ``model``: a catalog name (``kvwall models``), a path to a ``config.json``, a checkpoint folder or a ``.gguf``,
  a hub id, or a :class:`kvwall.spec.model.ModelSpec`.
- ``device``: a catalog device (``kvwall devices``) or ``"local"``.
- ``batch``, ``context``, ``prompt_tokens``: counts; a token count may be written ``4096``, ``"32k"`` or ``"1M"``.
- ``weight_format``, ``kv_format``, ``state_format``: storage formats (``"bf16"``, ``"fp8"``, ``"int4:g128"``...).
- ``kv_heads``, ``window``: what-ifs that re-shape the model (``--kv-heads``, ``--window``).
- ``tp``, ``pp``, ``ep``: tensor-, pipeline- and expert-parallel sizes.
- ``ideal``: the ideal roofline (datasheet peaks, a bound) instead of the default expected mode.

A bad argument raises :class:`kvwall.errors.KvwallError` with one line saying what is wrong.

Example:
    >>> from kvwall import api
    >>> api.memory("llama-3-8b", context="128k").cache_bytes   # 131,072 B per token x 131,072 tokens
    17179869184

This module imports no torch: predicting needs only the package's pure-Python core.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.predict import devices as dev
from kvwall.predict.memory import Formats, MemoryReport, Parallel
from kvwall.predict.roofline import PhaseResult, Roof
from kvwall.spec.model import ModelSpec, softmax_attention
from kvwall.units import parse_bytes, parse_int_list, parse_token_list, parse_tokens, real, seconds_arg, whole

__all__ = [
    "memory", "fit", "compare", "roofline", "speed", "simulate", "validate",
    "MemoryResult", "FitResult", "CompareResult", "CompareRow", "RooflineResult", "RooflinePoint",
    "SpeedResult", "SpeedRow", "SpeedPoint", "SimulateResult", "SimulatePoint", "ValidateResult",
]

Model = str | os.PathLike[str] | ModelSpec
Tokens = int | str
TokenList = int | str | Sequence[int | str]

LINEUP = catalog.LINEUP
COMPARE_CONTEXTS = "4k,32k,128k,1M"
SPEED_CONTEXTS = "1k,4k,16k,64k,128k,512k"
DEFAULT_DEVICE = "h100-sxm"
MLA_FORMS = ("absorbed", "naive")
VALIDATE_MODES = ("expected", "ideal")
SWEEPABLE = {"tp": "tp", "pp": "pp", "ep": "ep", "kv-format": "kv_format", "weight-format": "weight_format",
             "max-batch": "max_batch", "chunk": "chunk", "shared-prefix": "shared_prefix", "rate": "rate",
             "concurrency": "concurrency"}
RATE_RANGE = (0.01, 10_000.0)  # requests per second searched by simulate(find_rate=True)
GROUP = ("tp", "pp", "ep")  # a speed point's parallel sizes


# -- results -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class _Result:
    _json: str = field(repr=False, compare=False)

    def to_dict(self) -> dict:
        """What ``kvwall <command> --json`` prints for the same arguments, parsed: a fresh copy each call
        (JSON types only; all sizes in bytes, all times in seconds)."""
        return json.loads(self._json)


@dataclass(frozen=True, kw_only=True)
class MemoryResult(_Result):
    """Weights and cache of a model for a batch and context (``kvwall memory``).

    Attributes:
        model: The model's name.
        batch: Sequences.
        context: Tokens per sequence.
        weights_bytes: All weights, one copy, unsharded (``weight_bytes`` in ``to_dict()``).
        cache_bytes: The whole batch's cache (KV and fixed state), all GPUs together.
        cache_bytes_per_token: Bytes one token of context adds to one sequence while every layer keeps it.
        fixed_bytes_per_sequence: Fixed state per sequence (SSM state; 0 for pure attention), per GPU.
        per_gpu_weights_bytes: Weights on the busiest GPU.
        per_gpu_cache_bytes: Cache on the busiest GPU.
        per_gpu_bytes: Weights and cache on the busiest GPU.
        gpus: GPUs the model is spread over (tp x pp x ep).
        device: The device asked about, or None.
        fits: Whether the busiest GPU holds its weights and cache next to a 10 % reserve; None without a device.
        free_bytes: Memory left on that GPU after the reserve (negative: short by that much); None without a device.
        notes: What the model's config and the what-ifs changed, in words.
        spec: The model as predicted (after any ``kv_heads`` / ``window`` re-shaping).
        formats: The storage formats used.
        parallel: The parallel sizes.
        report: The per-layer breakdown (:class:`kvwall.predict.memory.MemoryReport`).
    """

    model: str
    batch: int
    context: int
    weights_bytes: int
    cache_bytes: int
    cache_bytes_per_token: int
    fixed_bytes_per_sequence: int
    per_gpu_weights_bytes: int
    per_gpu_cache_bytes: int
    per_gpu_bytes: int
    gpus: int
    device: str | None
    fits: bool | None
    free_bytes: int | None
    notes: tuple[str, ...]
    spec: ModelSpec = field(repr=False, compare=False)
    formats: Formats = field(repr=False, compare=False)
    parallel: Parallel = field(repr=False, compare=False)
    report: MemoryReport = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class FitResult(_Result):
    """The longest context for a batch, or the largest batch for a context (``kvwall fit``).

    Attributes:
        model: The model's name.
        device: The memory target in words (``"h100-sxm (80 GB)"``, or ``"80 GB"`` for a bare size).
        memory_bytes: Memory per GPU.
        reserve_bytes: Memory kept free per GPU.
        weights_bytes: Weights on the busiest GPU (``weight_bytes`` in ``to_dict()``).
        available_bytes: Memory left for the cache per GPU (negative: the weights do not fit).
        batch: The batch searched for its longest context, or None when a context was given.
        context: The context searched for its largest batch, or None when a batch was given.
        max_context: The longest context that fits (None with a given context, or when unbounded).
        max_batch: The largest batch that fits (None with a given batch).
        unbounded: True when any context fits (the cache stops growing: fixed state, sliding windows).
        weights_fit: Whether the weights fit at all (``kvwall fit`` exits 1 when not).
        model_max_context: The model's trained maximum context, or None.
        notes: What the model's config and the what-ifs changed, in words.
        spec: The model as predicted.
        formats: The storage formats used.
        parallel: The parallel sizes.
    """

    model: str
    device: str
    memory_bytes: int
    reserve_bytes: int
    weights_bytes: int
    available_bytes: int
    batch: int | None
    context: int | None
    max_context: int | None
    max_batch: int | None
    unbounded: bool
    weights_fit: bool
    model_max_context: int | None
    notes: tuple[str, ...]
    spec: ModelSpec = field(repr=False, compare=False)
    formats: Formats = field(repr=False, compare=False)
    parallel: Parallel = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class CompareRow:
    """One model's row of :func:`compare`.

    Attributes:
        model: The model's name.
        family: Its family (``attention``, ``latent``, ``hybrid``, ...).
        params: Its parameters.
        cache_bytes_per_token: Bytes a token adds while every layer still keeps it.
        growth_bytes_per_token: Bytes a token adds once sliding-window layers are full.
        state_bytes_per_sequence: Fixed state per sequence (SSM layers).
        cache_bytes: The batch's cache at each context asked for, keyed by the context in tokens.
        weights_bytes: Weights per GPU on the group chosen (``weight_bytes`` in ``to_dict()``).
        weights_fit: Whether the weights fit 8 GPUs or fewer.
        tp: The smallest tensor-parallel group (1, 2, 4 or 8) that holds the weights.
        max_context: The longest context that fits next to the weights (None when unbounded or not fitting).
        max_context_unbounded: True when any context fits (the cache stops growing).
        model_max_context: The model's trained maximum context, or None.
    """

    model: str
    family: str
    params: int
    cache_bytes_per_token: int
    growth_bytes_per_token: int
    state_bytes_per_sequence: int
    cache_bytes: Mapping[int, int]
    weights_bytes: int
    weights_fit: bool
    tp: int
    max_context: int | None
    max_context_unbounded: bool
    model_max_context: int | None


@dataclass(frozen=True, kw_only=True)
class CompareResult(_Result):
    """Cache per token and at several contexts, model beside model (``kvwall compare``).

    Attributes:
        batch: Sequences.
        contexts: The contexts compared, in tokens.
        memory_bytes: Memory per GPU for the "longest context that fits" column.
        memory_target: That memory in words.
        reserve_bytes: Memory kept free per GPU (10 %).
        models: One row per model, in the order asked.
    """

    batch: int
    contexts: tuple[int, ...]
    memory_bytes: int
    memory_target: str
    reserve_bytes: int
    models: tuple[CompareRow, ...]


@dataclass(frozen=True, kw_only=True)
class RooflinePoint:
    """One batch size of :func:`roofline`.

    Attributes:
        batch: Sequences.
        ttft_s: Time to the first token: the prefill of the prompt, seconds.
        tpot_s: Time per output token: one decode step at the context, seconds.
        tokens_per_s_per_seq: Decode tokens per second of one sequence (1 / tpot_s).
        tokens_per_s_total: Decode tokens per second of the batch.
        fits: Whether weights and the batch's cache fit the device (else the times are what-ifs).
        fit_reason: Why not, in words; None when it fits.
        decode_bound: ``"memory"`` or ``"compute"``: what bounds the decode step.
        energy_per_token_joules: Estimated energy per decoded token, or None where the device has no figures.
        prefill: The prefill phase, op by op (:class:`kvwall.predict.roofline.PhaseResult`).
        decode: The decode step, op by op.
    """

    batch: int
    ttft_s: float
    tpot_s: float
    tokens_per_s_per_seq: float
    tokens_per_s_total: float
    fits: bool
    fit_reason: str | None
    decode_bound: str
    energy_per_token_joules: float | None
    prefill: PhaseResult = field(repr=False, compare=False)
    decode: PhaseResult = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class RooflineResult(_Result):
    """FLOPs, bytes and time per op and per phase (``kvwall roofline``).

    Attributes:
        model: The model's name.
        device: The device's name.
        mode: ``"expected"`` or ``"ideal"``.
        context: Tokens in the cache at the decode step.
        prompt_tokens: Prompt tokens of the prefill.
        points: One per batch size asked, in order.
        fits: Whether every batch fits the device.
        weights_fit: Whether the weights fit (else every time is a what-if).
        compute_bound_batch_weights: The batch at which the weight matmuls turn compute-bound (None: above 65,536).
        compute_bound_batch_step: The batch at which the whole decode step does (None: never).
        ceiling_batch: The largest batch whose cache fits at the context (None when none does).
        ceiling_tokens_per_s: Decode tokens per second at that batch, all sequences together.
        notes: Notes on the model and the prediction.
        spec: The model as predicted.
        formats: The storage formats used.
        parallel: The parallel sizes.
        roof: The roof the times come from (:class:`kvwall.predict.roofline.Roof`).
    """

    model: str
    device: str
    mode: str
    context: int
    prompt_tokens: int
    points: tuple[RooflinePoint, ...]
    fits: bool
    weights_fit: bool
    compute_bound_batch_weights: int | None
    compute_bound_batch_step: int | None
    ceiling_batch: int | None
    ceiling_tokens_per_s: float | None
    notes: tuple[str, ...]
    spec: ModelSpec = field(repr=False, compare=False)
    formats: Formats = field(repr=False, compare=False)
    parallel: Parallel = field(repr=False, compare=False)
    roof: Roof = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class SpeedPoint:
    """One context of one model in :func:`speed`.

    Attributes:
        context: Tokens in the cache.
        tp: Tensor-parallel GPUs it ran on (the smallest group that fits, unless tp/pp/ep were given).
        pp: Pipeline stages.
        ep: Expert-parallel GPUs.
        gpus: All GPUs.
        fits: Whether weights and cache fit (else the time is a what-if).
        tpot_s: Decode time per token, seconds.
        tokens_per_s: Decode tokens per second per sequence.
    """

    context: int
    tp: int
    pp: int
    ep: int
    gpus: int
    fits: bool
    tpot_s: float
    tokens_per_s: float


@dataclass(frozen=True, kw_only=True)
class SpeedRow:
    """One model of :func:`speed`.

    Attributes:
        model: The model's name.
        family: Its family.
        ttft_s: Time to first token for the prompt, seconds.
        ttft_fits: Whether the prefill's point fits.
        points: Decode speed at each context, in order.
        weights_fit: Whether every context's point fits.
        fit_warning: Which points do not fit, in words; None when all do.
        notes: What the what-ifs changed, in words.
    """

    model: str
    family: str
    ttft_s: float
    ttft_fits: bool
    points: tuple[SpeedPoint, ...]
    weights_fit: bool
    fit_warning: str | None
    notes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class SpeedResult(_Result):
    """TTFT and decode speed against context, model against model (``kvwall speed``).

    Attributes:
        device: The device's name.
        mode: ``"expected"`` or ``"ideal"``.
        batch: Sequences.
        prompt_tokens: Prompt tokens for TTFT.
        fits: Whether every point of every model fits.
        models: One row per model, in the order asked.
    """

    device: str
    mode: str
    batch: int
    prompt_tokens: int
    fits: bool
    models: tuple[SpeedRow, ...]


@dataclass(frozen=True, kw_only=True)
class SimulatePoint:
    """One configuration of :func:`simulate` (one, without a sweep).

    Attributes:
        label: The sweep's values for it (``"tp=2 kv-format=fp8"``), or ``"run"``.
        mode: ``"rate"``, ``"concurrency"`` or ``"find-rate"``.
        rate: Poisson requests per second (found, with find_rate; None when none meets the SLO).
        concurrency: Clients, or None.
        tp: Tensor-parallel GPUs.
        pp: Pipeline stages.
        ep: Expert-parallel GPUs.
        gpus: All GPUs.
        completed: Requests completed.
        duration_s: Simulated seconds.
        request_throughput: Completed requests per second.
        output_token_throughput: Output tokens per second, all GPUs.
        goodput: Requests per second that met the SLO, or None without one.
        ttft_s: Time to first token: ``mean``, ``p50``, ``p90``, ``p99`` in seconds (None if none completed).
        tpot_s: Time per output token, the same statistics.
        preemptions: Requests preempted for want of KV blocks.
        kv_blocks: Blocks in the KV pool.
    """

    label: str
    mode: str
    rate: float | None
    concurrency: int | None
    tp: int
    pp: int
    ep: int
    gpus: int
    completed: int
    duration_s: float | None
    request_throughput: float | None
    output_token_throughput: float | None
    goodput: float | None
    ttft_s: Mapping[str, float] | None
    tpot_s: Mapping[str, float] | None
    preemptions: int
    kv_blocks: int


@dataclass(frozen=True, kw_only=True)
class SimulateResult(_Result):
    """A request stream served in simulated time (``kvwall simulate``).

    Attributes:
        model: The model as asked for.
        device: The device as asked for.
        points: One per configuration (a sweep's grid, in order).
    """

    model: str
    device: str
    points: tuple[SimulatePoint, ...]


@dataclass(frozen=True, kw_only=True)
class ValidateResult(_Result):
    """Predictions against the published measurements (``kvwall validate``).

    Attributes:
        mode: The mode whose errors the summary and ``predicted`` / ``error`` figures show.
        rows: Measurement rows selected.
        checked: Rows predicted and scored in that mode.
        skipped: Rows that could not be predicted.
        median_abs_error: The median |predicted / measured - 1| of that mode over the rows checked.
        median_error: The median signed error (positive: the prediction is faster).
        max_abs_error: The largest |error|.
        worst: The id of the row with the largest |error|.
        fit_written: Where ``fit=True`` wrote the refitted table, or None.
        loso_median_abs_error: Expected mode's median |error| scored leave-one-source-out (each row by a fit that
            saw no row of its source document), whatever ``mode``.
    """

    mode: str
    rows: int
    checked: int
    skipped: int
    median_abs_error: float | None
    median_error: float | None
    max_abs_error: float | None
    worst: str | None
    fit_written: str | None
    loso_median_abs_error: float | None = None


def _dumps(data: Any) -> str:
    from kvwall.report.tables import _default  # the CLI's --json encoder: the same bytes

    return json.dumps(data, default=_default)


# -- arguments ---------------------------------------------------------------------------------------------------

def _check(value: Any, parse: Callable[[str], Any], name: str) -> Any:
    """A value through the CLI option's own parser (so both refuse the same), its error as a KvwallError naming the
    keyword; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise KvwallError(f"{name} must be a number (got {value!r})")
    try:
        return parse(str(value))
    except argparse.ArgumentTypeError as exc:
        raise KvwallError(f"{name} {exc}") from None


def _text(value: Any, name: str) -> str | None:
    """A free-text argument: None, or a string that is not blank."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise KvwallError(f"{name} must be a string (got {type(value).__name__})")
    if not value.strip():
        raise KvwallError(f"{name} is empty; give a value, or leave it out for its default")
    return value


def _choice(value: str | None, names: Sequence[str], name: str) -> str | None:
    if value is None:
        return None
    key = str(value).strip().lower()
    if key not in names:
        raise KvwallError(f"{name} must be one of {', '.join(names)} (got {value!r})")
    return key


def _list_text(value: TokenList | None) -> str | None:
    """A list argument as the CLI's comma-separated text: 4096 -> '4096', [1, 8] -> '1,8', '4k,32k' unchanged."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def _tokens(value: Tokens, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        value = str(value)
    return parse_tokens(value, what)


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise KvwallError(f"{name} must be True or False (got {value!r})")
    return value


def _sizes(tp: Any, pp: Any, ep: Any) -> tuple[int | None, int | None, int | None]:
    """tp / pp / ep as the CLI's --tp / --pp / --ep check them (None stays None)."""
    size = whole(1, 1 << 16)
    return _check(tp, size, "tp"), _check(pp, size, "pp"), _check(ep, size, "ep")


def _parallel(tp: int | None, pp: int | None, ep: int | None) -> Parallel:
    return Parallel(tp or 1, pp or 1, ep or 1)


def _plot_path(plot: Any):
    """A plot's path checked before any work: a bad path is one line, not a traceback after the analysis."""
    from kvwall.files import PLOT_EXTS, check_output

    plot = _text(plot, "plot")
    return check_output(plot, PLOT_EXTS, option="--plot") if plot is not None else None


# -- the model, its formats, and the roof (shared with the commands: kvwall.commands.common, speed_cmds) -----------

def resolve(model: Model, *, kv_heads: int | None = None, window: Tokens | None = None,
            context: TokenList | None = None, weight_format: str | None = None, kv_format: str | None = None,
            state_format: str | None = None) -> tuple[ModelSpec, Formats, list[str]]:
    """The model as the predictor sees it: loaded, re-shaped by the what-ifs, with its storage formats.

    Args:
        model: Catalog name, config.json, checkpoint folder, .gguf, hub id, or a ModelSpec.
        kv_heads: Every attention layer gets this many KV heads (1 = MQA).
        window: Every attention layer gets a sliding window of this many tokens.
        context: The context(s) asked for (a window must be shorter than the longest, or the model's maximum).
        weight_format: Storage format of the weights (default: the checkpoint's own format, from its
            quantization_config, else its 16-bit type).
        kv_format: Storage format of the KV cache.
        state_format: Storage format of SSM state.

    Returns:
        (spec, formats, notes): the model, its formats, and what the what-ifs changed in words.
    """
    spec = _spec(model)
    spec, notes = reshape(spec, kv_heads=kv_heads, window=window, context=context)
    fm = Formats.for_spec(spec, _text(weight_format, "weight_format"), _text(kv_format, "kv_format"),
                          _text(state_format, "state_format"))
    return spec, fm, notes


def _spec(model: Model) -> ModelSpec:
    from kvwall.spec.resolve import load_spec

    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise KvwallError(f"model must be a name, a path or a ModelSpec (got {type(model).__name__})")
    return load_spec(model)


def reshape(spec: ModelSpec, *, kv_heads: int | None = None, window: Tokens | None = None,
            context: TokenList | None = None) -> tuple[ModelSpec, list[str]]:
    """Apply the ``kv_heads`` / ``window`` what-ifs; return the new spec and what was changed, in words."""
    notes = []
    if kv_heads is not None:
        n = _check(kv_heads, whole(1), "kv_heads")
        heads = {a.n_q_heads for a in map(softmax_attention, (layer.mixer for layer in spec.layers)) if a is not None}
        if not heads:
            raise KvwallError(f"--kv-heads: {spec.name} has no (non-latent) attention layers to re-shape")
        if n <= 0 or any(h % n for h in heads):
            raise KvwallError(f"--kv-heads {n}: must divide the query heads ({', '.join(map(str, sorted(heads)))})")
        spec = spec.with_kv_heads(n)
        notes.append(f"re-shaped: every attention layer has {n} KV heads")
    if window is not None:
        w = _tokens(window, "window")
        if not any(softmax_attention(layer.mixer) for layer in spec.layers):
            raise KvwallError(f"--window: {spec.name} has no (non-latent) attention layers to give a window")
        asked = max(parse_token_list(_list_text(context), "context")) if context else 0
        if w >= max(spec.max_context or 0, asked) > 0:  # contexts past the maximum are what-ifs, where it slides
            what = (f"{spec.name}'s maximum context {spec.max_context}" if (spec.max_context or 0) >= asked
                    else f"the longest --context asked for ({asked})")
            raise KvwallError(f"--window {w} is not shorter than {what}; such a window never slides: "
                              "pick a smaller one")
        spec = spec.with_window(w)
        notes.append(f"re-shaped: every attention layer has a sliding window of {w} tokens")
    return spec, notes


_IDEAL_KNOBS = ("compute_eff", "mem_eff", "link_latency")


def roof_for(spec: ModelSpec, fm: Formats, tp: int = 1, *, device: str = DEFAULT_DEVICE,
             compute_dtype: str | None = None, ideal: bool = False, compute_eff: float | None = None,
             mem_eff: float | None = None, link_latency: float | None = None) -> Roof:
    """The roof these options describe for this model, formats and collective group of ``tp`` GPUs.

    Args:
        spec: The model.
        fm: Its storage formats.
        tp: GPUs in each collective (tensor- or expert-parallel group).
        device: Catalog device or ``"local"``.
        compute_dtype: dtype of the math (default: fp32 or fp16 when the weights are, else bf16).
        ideal: The ideal roofline instead of expected mode.
        compute_eff: With ideal: fraction of peak FLOP/s reached (default 1.0).
        mem_eff: With ideal: fraction of bandwidth reached (default 1.0).
        link_latency: With ideal: microseconds per collective (default 5).

    Returns:
        The roof (:class:`kvwall.predict.roofline.Roof`).
    """
    from kvwall.predict.expected import expected_roof
    from kvwall.predict.roofline import default_compute_dtype

    device = _text(device, "device")
    ideal = _flag(ideal, "ideal")
    compute_dtype = _choice(compute_dtype, dev.COMPUTE_DTYPES, "compute_dtype")
    fraction = real(0, 1, lo_open=True)
    knobs = {"compute_eff": _check(compute_eff, fraction, "compute_eff"),
             "mem_eff": _check(mem_eff, fraction, "mem_eff"),
             "link_latency": _check(link_latency, real(0), "link_latency")}
    d = dev.get_device(device)
    dtype = compute_dtype or default_compute_dtype(fm)
    if ideal:
        link = knobs["link_latency"]
        roof = Roof(d, dtype, knobs["compute_eff"] or 1.0, knobs["mem_eff"] or 1.0,
                    (5.0 if link is None else link) * 1e-6)
    else:
        given = [f"--{k.replace('_', '-')}" for k in _IDEAL_KNOBS if knobs[k] is not None]
        if given:
            raise KvwallError(f"{', '.join(given)} set the ideal roof's figures; add --ideal (expected mode uses "
                              "the fractions fitted in catalog/efficiency.json)")
        roof = expected_roof(d, dtype, fm, spec, tp)
    if roof.bandwidth != roof.bandwidth:
        raise KvwallError(f"device {device!r} has no bandwidth figure")
    _ = roof.peak  # raises a clear error if the dtype has no peak on this device
    return roof


def _memory_target(device: str | None, mem: Any) -> tuple[int, str]:
    device, mem = _text(device, "device"), None if mem is None else str(mem)
    if mem is not None and not mem.strip():
        raise KvwallError("memory is empty; give a size such as 80GB, or leave it out")
    if mem and device:
        raise KvwallError(f"--memory {mem} and --device {device} both say how much memory there is; give one")
    if mem:
        b = parse_bytes(mem)
        return b, f"{b / 1e9:g} GB"
    d = dev.get_device(device or DEFAULT_DEVICE)
    return d.memory_bytes, f"{d.name} ({d.memory_bytes / 1e9:g} GB)"


def _positive(n: int | None, what: str) -> None:
    if n is not None and n <= 0:
        raise KvwallError(f"{what} must be at least 1 (got {n})")


# -- memory ------------------------------------------------------------------------------------------------------

def memory(model: Model, *, context: Tokens = "4k", batch: int = 1, block_size: int | None = None,
           device: str | None = None, kv_heads: int | None = None, window: Tokens | None = None,
           weight_format: str | None = None, kv_format: str | None = None, state_format: str | None = None,
           tp: int = 1, pp: int = 1, ep: int = 1) -> MemoryResult:
    """Weights and cache for a batch and context, per layer and per GPU (``kvwall memory``).

    Args:
        model: Catalog name, config.json, checkpoint folder, .gguf, hub id, or a ModelSpec.
        context: Tokens per sequence (4096, "128k", "1M").
        batch: Sequences.
        block_size: Paged allocation: round each sequence up to blocks of this many tokens.
        device: Also say whether it fits this device (10 % kept in reserve).
        kv_heads: What-if: every attention layer gets this many KV heads.
        window: What-if: a sliding window of this many tokens on every attention layer.
        weight_format: Storage format of the weights.
        kv_format: Storage format of the KV cache.
        state_format: Storage format of SSM state.
        tp: Tensor-parallel GPUs.
        pp: Pipeline stages.
        ep: Expert-parallel GPUs per stage (not with tp).

    Returns:
        MemoryResult: bytes of weights and cache; ``to_dict()`` is ``kvwall memory --json``.

    Example:
        >>> r = memory("llama-3-8b", context="128k", batch=8, kv_format="fp8")
        >>> r.cache_bytes == 8 * 131_072 * 65_536   # fp8: 1 byte per element, half of bf16's 131,072 B/token
        True
    """
    from kvwall.predict.fit import headroom
    from kvwall.predict.memory import memory as _memory

    batch = _check(batch, whole(1), "batch")
    block_size = _check(block_size, whole(1), "block_size")
    tp, pp, ep = _sizes(tp, pp, ep)
    device = _text(device, "device")
    spec, fm, notes = resolve(model, kv_heads=kv_heads, window=window, context=context, weight_format=weight_format,
                              kv_format=kv_format, state_format=state_format)
    ctx = _tokens(context, "context")
    _positive(batch, "--batch")
    rep = _memory(spec, batch=batch, context=ctx, formats=fm, parallel=_parallel(tp, pp, ep), block_size=block_size)
    data = rep.as_dict() | {"notes": list(spec.notes) + notes}
    w, cache = rep.per_gpu()
    d = dev.get_device(device) if device else None
    room = None
    if d:
        room = headroom(d.memory_bytes, w + cache)
        data["device"] = {"name": d.name, "memory_bytes": d.memory_bytes, "reserve_bytes": room.reserve_bytes,
                          "fits": room.fits, "free_bytes": room.free_bytes}
    return MemoryResult(
        _json=_dumps(data), model=spec.name, batch=batch, context=ctx, weights_bytes=rep.weight_bytes,
        cache_bytes=rep.cache_bytes, cache_bytes_per_token=data["cache_bytes_per_token"],
        fixed_bytes_per_sequence=rep.fixed_bytes, per_gpu_weights_bytes=w, per_gpu_cache_bytes=cache,
        per_gpu_bytes=w + cache, gpus=rep.parallel.gpus, device=d.name if d else None,
        fits=room.fits if room else None, free_bytes=room.free_bytes if room else None,
        notes=tuple(data["notes"]), spec=spec, formats=fm, parallel=rep.parallel, report=rep)


# -- fit ---------------------------------------------------------------------------------------------------------

def fit(model: Model, *, device: str | None = None, memory: int | str | None = None, batch: int | None = None,
        context: Tokens | None = None, reserve: int | str | None = None, block_size: int | None = None,
        kv_heads: int | None = None, window: Tokens | None = None, weight_format: str | None = None,
        kv_format: str | None = None, state_format: str | None = None, tp: int = 1, pp: int = 1,
        ep: int = 1) -> FitResult:
    """The longest context for a batch, or the largest batch for a context (``kvwall fit``).

    Args:
        model: Catalog name, config.json, checkpoint folder, .gguf, hub id, or a ModelSpec.
        device: Catalog device (default h100-sxm unless ``memory``).
        memory: Memory per GPU instead of a device: bytes, or a size such as "80GB" or "24GiB".
        batch: Find the longest context for this batch (default 1).
        context: Find the largest batch for this context instead (not with ``batch``).
        reserve: Memory kept free per GPU: "10%", a size such as "4GB", or bytes (default 10 %).
        block_size: Paged allocation block size in tokens.
        kv_heads: What-if: every attention layer gets this many KV heads.
        window: What-if: a sliding window of this many tokens on every attention layer.
        weight_format: Storage format of the weights.
        kv_format: Storage format of the KV cache.
        state_format: Storage format of SSM state.
        tp: Tensor-parallel GPUs.
        pp: Pipeline stages.
        ep: Expert-parallel GPUs per stage.

    Returns:
        FitResult: the longest context or largest batch; ``to_dict()`` is ``kvwall fit --json``.

    Example:
        >>> r = fit("llama-3-8b", memory="80GB", batch=8)   # 80 GB - 8 GB reserve - 16.06 GB weights
        >>> r.max_context == (80 * 10**9 - 8 * 10**9 - 16_060_522_496) // (8 * 131_072)
        True
    """
    from kvwall.predict.fit import fit as _fit, parse_reserve

    batch = _check(batch, whole(1), "batch")
    block_size = _check(block_size, whole(1), "block_size")
    tp, pp, ep = _sizes(tp, pp, ep)
    if batch is not None and context is not None:
        raise KvwallError("give --batch (to find the longest context) or --context (to find the largest batch), "
                          "not both")
    _positive(batch, "--batch")
    spec, fm, notes = resolve(model, kv_heads=kv_heads, window=window, context=context, weight_format=weight_format,
                              kv_format=kv_format, state_format=state_format)
    mem_bytes, where = _memory_target(device, memory)
    ctx = _tokens(context, "context") if context else None
    par = _parallel(tp, pp, ep)
    res = _fit(spec, mem_bytes, batch=None if ctx else (batch or 1), context=ctx, formats=fm, parallel=par,
               reserve_bytes=parse_reserve(reserve, mem_bytes), block_size=block_size)
    data = res.as_dict() | {"model": spec.name, "device": where, "formats": fm.as_dict(), **par.as_dict(),
                            "model_max_context": spec.max_context, "notes": list(spec.notes) + notes}
    return FitResult(
        _json=_dumps(data), model=spec.name, device=where, memory_bytes=res.memory_bytes,
        reserve_bytes=res.reserve_bytes, weights_bytes=res.weight_bytes, available_bytes=res.available_bytes,
        batch=res.batch, context=res.context, max_context=res.max_context, max_batch=res.max_batch,
        unbounded=res.unbounded, weights_fit=res.weights_fit, model_max_context=spec.max_context,
        notes=tuple(data["notes"]), spec=spec, formats=fm, parallel=par)


# -- compare -----------------------------------------------------------------------------------------------------

def compare(models: Model | Sequence[Model] | None = None, *, context: TokenList = COMPARE_CONTEXTS, batch: int = 1,
            device: str | None = None, memory: int | str | None = None, kv_heads: int | None = None,
            window: Tokens | None = None, weight_format: str | None = None, kv_format: str | None = None,
            state_format: str | None = None) -> CompareResult:
    """Cache per token and at several contexts, side by side (``kvwall compare``).

    Args:
        models: A model or a list of them (default: the catalog's line-up, from GPT-2 XL to Jamba).
        context: Contexts: "4k,32k,128k,1M", or a list such as [4096, "128k"].
        batch: Sequences.
        device: Device for the "longest context that fits" figure (default h100-sxm).
        memory: Memory per GPU instead of a device (bytes, or "80GB").
        kv_heads: What-if: every attention layer gets this many KV heads.
        window: What-if: a sliding window of this many tokens on every attention layer.
        weight_format: Storage format of the weights.
        kv_format: Storage format of the KV cache.
        state_format: Storage format of SSM state.

    Returns:
        CompareResult: one row per model; ``to_dict()`` is ``kvwall compare --json``.

    Example:
        >>> r = compare(["llama-3-8b", "deepseek-v3"], context="128k")
        >>> [m.cache_bytes_per_token for m in r.models]   # 2*32*8*128*2; (512+64)*61*2
        [131072, 70272]
    """
    from kvwall.predict.fit import compare_entry, default_reserve

    batch = _check(batch, whole(1), "batch")
    contexts = parse_token_list(_list_text(context), "context")
    _positive(batch, "--batch")
    mem_bytes, where = _memory_target(device, memory)
    out = []
    for name in _models(models, default=LINEUP):
        spec, fm, notes = resolve(name, kv_heads=kv_heads, window=window, context=context,
                                  weight_format=weight_format, kv_format=kv_format, state_format=state_format)
        out.append(compare_entry(spec, fm, contexts, batch, mem_bytes) | {"notes": notes})
    data = {"batch": batch, "memory_bytes": mem_bytes, "memory_target": where,
            "reserve_bytes": default_reserve(mem_bytes), "contexts": contexts, "models": out}
    rows = tuple(CompareRow(
        model=r["model"], family=r["family"], params=r["params"], cache_bytes_per_token=r["cache_bytes_per_token"],
        growth_bytes_per_token=r["growth_bytes_per_token"], state_bytes_per_sequence=r["state_bytes_per_sequence"],
        cache_bytes={int(c): b for c, b in r["cache_bytes"].items()}, weights_bytes=r["weight_bytes"],
        weights_fit=r["weights_fit"], tp=r["tp"], max_context=r["max_context"],
        max_context_unbounded=r["max_context_unbounded"], model_max_context=r["model_max_context"]) for r in out)
    return CompareResult(_json=_dumps(data), batch=batch, contexts=tuple(contexts), memory_bytes=mem_bytes,
                         memory_target=where, reserve_bytes=data["reserve_bytes"], models=rows)


def _models(models: Any, default: Sequence[str] | None = None) -> list:
    if models is None or (isinstance(models, (list, tuple)) and not models):
        if default is None:
            raise KvwallError("give at least one model")
        return list(default)
    if isinstance(models, (str, os.PathLike, ModelSpec)):
        return [models]
    return list(models)


# -- roofline ----------------------------------------------------------------------------------------------------

def roofline(model: Model, *, batch: int | str | Sequence[int] = 1, context: Tokens = "4k",
             prompt_tokens: Tokens = "2k", mla: str | None = None, micro_batches: int | None = None,
             plot: str | os.PathLike | None = None, kv_heads: int | None = None, window: Tokens | None = None,
             weight_format: str | None = None, kv_format: str | None = None, state_format: str | None = None,
             tp: int = 1, pp: int = 1, ep: int = 1, device: str = DEFAULT_DEVICE, compute_dtype: str | None = None,
             ideal: bool = False, compute_eff: float | None = None, mem_eff: float | None = None,
             link_latency: float | None = None) -> RooflineResult:
    """FLOPs, bytes, intensity and time per op and per phase (``kvwall roofline``).

    Args:
        model: Catalog name, config.json, checkpoint folder, .gguf, hub id, or a ModelSpec.
        batch: Batch size(s): 8, "1,8,64" or [1, 8, 64].
        context: Tokens in the cache at the decode step.
        prompt_tokens: Prompt tokens for prefill / TTFT (``--prompt``).
        mla: MLA decode form, "absorbed" (default) or "naive"; only for models with latent attention.
        micro_batches: With pp > 1: the decode batch split into this many micro-batches (default pp).
        plot: Write a roofline chart here (.png, .svg or .pdf).
        kv_heads: What-if: every attention layer gets this many KV heads.
        window: What-if: a sliding window of this many tokens on every attention layer.
        weight_format: Storage format of the weights.
        kv_format: Storage format of the KV cache.
        state_format: Storage format of SSM state.
        tp: Tensor-parallel GPUs.
        pp: Pipeline stages.
        ep: Expert-parallel GPUs per stage.
        device: Catalog device or "local".
        compute_dtype: dtype of the math (default: from the weight format).
        ideal: The ideal roofline (datasheet peaks, no fixed costs: a bound) instead of expected mode.
        compute_eff: With ideal: fraction of peak FLOP/s reached.
        mem_eff: With ideal: fraction of bandwidth reached.
        link_latency: With ideal: microseconds per collective.

    Returns:
        RooflineResult: times per batch, op by op; ``to_dict()`` is ``kvwall roofline --json``.

    Example:
        >>> r = roofline("llama-3-8b", ideal=True)   # batch 1 at 4k on an H100: 3.35 TB/s, 989 TFLOP/s
        >>> r.points[0].decode_bound   # 15.0 GB of weights (all but the embedding table) + 0.54 GB of cache
        'memory'
        >>> round(r.points[0].tpot_s * 1e3, 1)   # ms: 15.55 GB / 3.35 TB/s
        4.6
    """
    from kvwall.predict.expected import describe
    from kvwall.predict.fit import fit as _fit, fit_warning
    from kvwall.predict.roofline import compute_bound_batch, decode, energy_estimate, prefill

    plot_path = _plot_path(plot)
    tp, pp, ep = _sizes(tp, pp, ep)
    micro_batches = _check(micro_batches, whole(1, 1 << 16), "micro_batches")
    mla = _choice(mla, MLA_FORMS, "mla")
    spec, fm, notes = resolve(model, kv_heads=kv_heads, window=window, context=context, weight_format=weight_format,
                              kv_format=kv_format, state_format=state_format)
    par = _parallel(tp, pp, ep)
    roof = roof_for(spec, fm, par.group, device=device, compute_dtype=compute_dtype, ideal=ideal,
                    compute_eff=compute_eff, mem_eff=mem_eff, link_latency=link_latency)
    batches = parse_int_list(_list_text(batch), "batch")
    ctx, prompt = _tokens(context, "context"), _tokens(prompt_tokens, "prompt")
    if mla is not None and not (spec.has("latent") or spec.has("sparse_latent")):  # DSA is MLA too
        raise KvwallError(f"--mla {mla}: {spec.name} has no MLA (latent attention) layers to decode either way")
    absorbed = None if mla is None else mla == "absorbed"
    energy = catalog.energy_table()
    phases = []
    for b in batches:
        pf = prefill(spec, prompt, b, fm, roof, par)
        dc = decode(spec, ctx, b, fm, roof, par, absorbed)
        why = fit_warning(spec, roof.device.memory_bytes, par, batch=b, context=ctx, formats=fm,
                          device=roof.device.name)
        piped = _pipelined(spec, ctx, b, fm, roof, par, micro_batches)
        phases.append({"batch": b, "prefill": pf, "decode": dc, "fits": why is None, "fit_reason": why,
                       "pipelined_decode": piped,
                       "ttft_s": pf.time_s, "tpot_s": dc.time_s, "tokens_per_s_per_seq": 1 / dc.time_s,
                       "tokens_per_s_total": b / dc.time_s,
                       "energy_per_token": _per_token(energy_estimate(dc, roof, energy), b)})
    mem = _fit(spec, roof.device.memory_bytes, context=ctx, formats=fm, parallel=par)
    ceiling = None
    if mem.weights_fit and mem.max_batch:
        top = decode(spec, ctx, mem.max_batch, fm, roof, par, absorbed)
        ceiling = {"batch": mem.max_batch, "tokens_per_s_total": mem.max_batch / top.time_s, "tpot_s": top.time_s}
    data = {
        "mode": roof.mode, "mode_text": describe(roof), "fits": all(p["fits"] for p in phases),
        "model": spec.name, "formats": fm.as_dict(), **par.as_dict(), "parallel": par.label(), "context": ctx,
        "prompt": prompt,
        "assumptions": roof.assumptions() | {"mla_decode": _mla_mode(spec, absorbed)},
        "phases": [{**{k: v for k, v in p.items() if k not in ("prefill", "decode")},
                    "prefill": p["prefill"].as_dict(), "decode": p["decode"].as_dict()} for p in phases],
        "compute_bound_batch_weights": compute_bound_batch(spec, ctx, fm, roof, par, scope="weights"),
        "compute_bound_batch_step": compute_bound_batch(spec, ctx, fm, roof, par, scope="step"),
        "throughput_ceiling": ceiling, "weights_fit": mem.weights_fit,
        "notes": list(spec.notes) + notes + _fit_note(mem.weights_fit, spec.name, roof.device.name),
    }
    if plot_path:
        from kvwall.report import plots
        from kvwall.report.analysis import roofline_points

        plots.roofline(roofline_points((phases[0]["prefill"], phases[0]["decode"])), roof.peak, roof.bandwidth,
                       f"{spec.name} on {roof.device.name}, batch {phases[0]['batch']}: ops under the roof", plot_path)
        data["plot"] = _text(plot, "plot")
    points = tuple(RooflinePoint(
        batch=p["batch"], ttft_s=p["ttft_s"], tpot_s=p["tpot_s"], tokens_per_s_per_seq=p["tokens_per_s_per_seq"],
        tokens_per_s_total=p["tokens_per_s_total"], fits=p["fits"], fit_reason=p["fit_reason"],
        decode_bound=p["decode"].bound, energy_per_token_joules=p["energy_per_token"].get("joules"),
        prefill=p["prefill"], decode=p["decode"]) for p in phases)
    return RooflineResult(
        _json=_dumps(data), model=spec.name, device=roof.device.name, mode=roof.mode, context=ctx,
        prompt_tokens=prompt, points=points, fits=data["fits"], weights_fit=mem.weights_fit,
        compute_bound_batch_weights=data["compute_bound_batch_weights"],
        compute_bound_batch_step=data["compute_bound_batch_step"],
        ceiling_batch=ceiling["batch"] if ceiling else None,
        ceiling_tokens_per_s=ceiling["tokens_per_s_total"] if ceiling else None, notes=tuple(data["notes"]),
        spec=spec, formats=fm, parallel=par, roof=roof)


def _pipelined(spec, ctx: int, batch: int, fm, roof: Roof, par, micro: int | None) -> dict | None:
    """With pp > 1: the decode step with the batch in micro-batches (None when pp is 1 or m does not divide)."""
    from kvwall.predict.roofline import pipelined
    from kvwall.predict.step import Step

    if par.pp == 1:
        if micro:
            raise KvwallError("--micro-batches needs pipeline stages: add --pp N")
        return None
    m = micro or par.pp
    if batch % m:
        return {"skipped": f"{m} micro-batches do not divide batch {batch}"}
    return pipelined(spec, Step(batch, ctx - 1, 1), fm, roof, par, m)


def _fit_note(fits: bool, model: str, device: str) -> list[str]:
    return [] if fits else [f"{model}'s weights do not fit one {device} at this tp/pp: times are what-ifs "
                            "(add --tp/--pp or a smaller --weight-format)"]


def _mla_mode(spec, absorbed) -> str | None:
    if not (spec.has("latent") or spec.has("sparse_latent")):
        return None
    return "naive" if absorbed is False else "absorbed"


def _per_token(e: dict, batch: int) -> dict:
    return {k: (v / batch if isinstance(v, float) and k.endswith("joules") else v) for k, v in e.items()}


# -- speed -------------------------------------------------------------------------------------------------------

def speed(models: Model | Sequence[Model], *, context: TokenList = SPEED_CONTEXTS, prompt_tokens: Tokens = "2k",
          batch: int = 1, plot: str | os.PathLike | None = None, kv_heads: int | None = None,
          window: Tokens | None = None, weight_format: str | None = None, kv_format: str | None = None,
          state_format: str | None = None, tp: int | None = None, pp: int | None = None, ep: int | None = None,
          device: str = DEFAULT_DEVICE, compute_dtype: str | None = None, ideal: bool = False,
          compute_eff: float | None = None, mem_eff: float | None = None,
          link_latency: float | None = None) -> SpeedResult:
    """TTFT and decode speed against context, model against model (``kvwall speed``).

    Args:
        models: A model or a list of them.
        context: Contexts: "1k,4k,128k" or a list such as [4096, "128k"].
        prompt_tokens: Prompt tokens for TTFT (``--prompt``).
        batch: Sequences.
        plot: Write decode time per token against context here (.png, .svg or .pdf).
        kv_heads: What-if: every attention layer gets this many KV heads.
        window: What-if: a sliding window of this many tokens on every attention layer.
        weight_format: Storage format of the weights.
        kv_format: Storage format of the KV cache.
        state_format: Storage format of SSM state.
        tp: Tensor-parallel GPUs. Leaving tp, pp and ep all out: each point runs on the smallest of 1, 2, 4, 8 GPUs
            on which the model and its cache fit.
        pp: Pipeline stages.
        ep: Expert-parallel GPUs per stage.
        device: Catalog device or "local".
        compute_dtype: dtype of the math.
        ideal: The ideal roofline instead of expected mode.
        compute_eff: With ideal: fraction of peak FLOP/s reached.
        mem_eff: With ideal: fraction of bandwidth reached.
        link_latency: With ideal: microseconds per collective.

    Returns:
        SpeedResult: per model, TTFT and tokens per second at each context; ``to_dict()`` is
        ``kvwall speed --json``.

    Example:
        >>> r = speed("llama-3-70b", context="4k", ideal=True)
        >>> r.models[0].points[0].tp   # 141 GB of bf16 weights: two 80 GB GPUs
        2
    """
    from kvwall.predict.expected import describe

    plot_path = _plot_path(plot)
    batch = _check(batch, whole(1), "batch")
    sizes = _sizes(tp, pp, ep)
    contexts = parse_token_list(_list_text(context), "context")
    prompt = _tokens(prompt_tokens, "prompt")
    if batch <= 0:
        raise KvwallError(f"--batch must be at least 1 (got {batch})")
    knobs = dict(kv_heads=kv_heads, window=window, context=context, weight_format=weight_format, kv_format=kv_format,
                 state_format=state_format)
    roof_knobs = dict(device=device, compute_dtype=compute_dtype, ideal=ideal, compute_eff=compute_eff,
                      mem_eff=mem_eff, link_latency=link_latency)
    rows = [_speed_row(name, batch, contexts, prompt, sizes, knobs, roof_knobs) for name in _models(models)]
    roof = rows[0][1]
    out = [r for r, _ in rows]
    data = {"mode": roof.mode, "mode_text": describe(roof), "device": roof.device.name, "batch": batch,
            "prompt": prompt, "fits": all(m["weights_fit"] and m["ttft_fits"] for m in out),
            "assumptions": roof.assumptions(), "models": out}
    if plot_path:
        from kvwall.report import plots

        plots.lines({m["model"]: [(r["context"], r["tpot_s"] * 1e3) for r in m["decode"] if r["fits"]]
                     for m in out},
                    "context (tokens)", "decode time per token (ms)",
                    f"The memory wall on {roof.device.name}: decode time vs context (batch {batch})", plot_path)
        data["plot"] = _text(plot, "plot")
    typed = tuple(SpeedRow(
        model=m["model"], family=m["family"], ttft_s=m["ttft_s"], ttft_fits=m["ttft_fits"],
        points=tuple(SpeedPoint(context=r["context"], tp=r["tp"], pp=r["pp"], ep=r["ep"], gpus=r["gpus"],
                                fits=r["fits"], tpot_s=r["tpot_s"], tokens_per_s=r["tokens_per_s"])
                     for r in m["decode"]),
        weights_fit=m["weights_fit"], fit_warning=m["fit_warning"], notes=tuple(m["notes"])) for m in out)
    return SpeedResult(_json=_dumps(data), device=roof.device.name, mode=roof.mode, batch=batch,
                       prompt_tokens=prompt, fits=data["fits"], models=typed)


def _speed_row(name, batch: int, contexts: list[int], prompt: int, sizes: tuple, knobs: dict,
               roof_knobs: dict) -> tuple[dict, Roof]:
    """One model: TTFT and decode speed per context, each on the group it fits (or tp/pp/ep as given);
    and its roof on one GPU (for the assumptions)."""
    from kvwall.predict.fit import TP_DEGREES, fits_on, placement
    from kvwall.predict.roofline import decode, prefill

    spec, fm, notes = resolve(name, **knobs)
    auto = all(s is None for s in sizes)
    roof = roof_for(spec, fm, **roof_knobs)

    def point(context: int) -> dict:
        if auto:
            p = placement(spec, roof.device.memory_bytes, batch=batch, context=context, formats=fm)
            par = Parallel(p.group)
        else:
            par = _parallel(*sizes)
        fits = fits_on(spec, roof.device.memory_bytes, par, batch=batch, context=context, formats=fm)
        return {"context": context, **par.as_dict(), "fits": fits}, par

    first, par = point(prompt)
    ttft = prefill(spec, prompt, batch, fm, roof_for(spec, fm, par.group, **roof_knobs), par).time_s
    per_ctx = []
    for c in contexts:
        r, par = point(c)
        r["tpot_s"] = decode(spec, c, batch, fm, roof_for(spec, fm, par.group, **roof_knobs), par).time_s
        r["tokens_per_s"] = 1 / r["tpot_s"]
        per_ctx.append(r)
    fits = all(r["fits"] for r in per_ctx)
    bad, warning = next((r for r in (first, *per_ctx) if not r["fits"]), None), None
    if bad is not None:  # a what-if runs on --tp/--pp as given, else on the widest split the heads allow
        where = ("this tp/pp" if not auto else f"{TP_DEGREES[-1]} GPUs" if bad["tp"] == TP_DEGREES[-1]
                 else f"the widest split its heads allow (tp {bad['tp']})")
        warning = (f"{spec.name}: points marked (!) do not fit {where} of {roof.device.name} (weights + batch x "
                   "context of cache, 10 % reserve); their times are what-ifs")
    return {"model": spec.name, "family": spec.family(), "formats": fm.as_dict(), "ttft_s": ttft,
            "ttft_fits": first["fits"], **{f"ttft_{k}": first[k] for k in GROUP}, "decode": per_ctx,
            "weights_fit": fits, "fit_warning": warning, "notes": list(spec.notes) + notes}, roof  # as memory's


# -- simulate ----------------------------------------------------------------------------------------------------

Progress = Callable[[str], AbstractContextManager[Callable[[float, int], None]]]


def simulate(model: Model, *, rate: float | None = None, concurrency: int | None = None, requests: int = 1000,
             prompt_tokens: int | str = "512", output_tokens: int | str = "128", dataset: str | None = None,
             kv_memory: int | str | None = None, reserve: int | str | None = None, shared_prefix: int = 0,
             chunk: int = 512, max_batch: int = 256, block_size: int = 16, split_prefill: bool = False,
             seed: int = 0, slo_ttft: float | str | None = None, slo_tpot: float | str | None = None,
             find_rate: bool = False, sweep: Sequence[str] | Mapping[str, Any] | None = None,
             plot: str | os.PathLike | None = None, kv_heads: int | None = None, window: Tokens | None = None,
             weight_format: str | None = None, kv_format: str | None = None, state_format: str | None = None,
             tp: int = 1, pp: int = 1, ep: int = 1, device: str = DEFAULT_DEVICE, compute_dtype: str | None = None,
             ideal: bool = False, compute_eff: float | None = None, mem_eff: float | None = None,
             link_latency: float | None = None, progress: Progress | None = None) -> SimulateResult:
    """A request stream served in simulated time: latency percentiles, throughput, goodput (``kvwall simulate``).

    kvwall serve's scheduler, each step timed by the roofline of its exact mix of prefill chunks and decode tokens.

    Args:
        model: Catalog name, config.json, checkpoint folder, .gguf, hub id, or a ModelSpec.
        rate: Poisson arrivals, requests per second (or ``concurrency``, or ``find_rate``).
        concurrency: This many clients, one request at a time each.
        requests: Requests in the stream.
        prompt_tokens: Prompt lengths: 512, "lognormal:mean=512,sd=0.5" or "uniform:min=64,max=1024".
        output_tokens: Output lengths, the same forms.
        dataset: Requests from a JSONL file ({"prompt_tokens" or "prompt", "output_tokens"} a line).
        kv_memory: KV pool per GPU, bytes or "40GB" (default: what is left; not with ``reserve``).
        reserve: Memory kept free per GPU: "10%" or a size (default 10 %).
        shared_prefix: Every prompt begins with the same this many tokens (a system prompt).
        chunk: Token budget per step.
        max_batch: Requests running at once.
        block_size: Tokens per KV block.
        split_prefill: Decode rows in one forward, prefill chunks in one per length, as kvwall serve runs them.
        seed: Random seed of the stream.
        slo_ttft: Goodput: TTFT at most this, seconds or "1s".
        slo_tpot: Goodput: time per output token at most this, seconds or "100ms".
        find_rate: Search for the largest Poisson rate whose p90 TTFT and TPOT meet the SLO.
        sweep: A grid: ["tp=1,2,4", "kv-format=bf16,fp8"] or {"tp": [1, 2, 4], "kv-format": ["bf16", "fp8"]}.
        plot: Write latency CDFs and KV blocks over time (a sweep: a Pareto plot) here.
        kv_heads: What-if: every attention layer gets this many KV heads.
        window: What-if: a sliding window of this many tokens on every attention layer.
        weight_format: Storage format of the weights.
        kv_format: Storage format of the KV cache.
        state_format: Storage format of SSM state.
        tp: Tensor-parallel GPUs.
        pp: Pipeline stages.
        ep: Expert-parallel GPUs per stage.
        device: Catalog device or "local".
        compute_dtype: dtype of the math.
        ideal: The ideal roofline instead of expected mode.
        compute_eff: With ideal: fraction of peak FLOP/s reached.
        mem_eff: With ideal: fraction of bandwidth reached.
        link_latency: With ideal: microseconds per collective.
        progress: Called with a run's description, returns a context manager whose value is called as
            ``tick(simulated_seconds, finished_requests)`` while it runs (the CLI's status line). Default: none.

    Returns:
        SimulateResult: one point per configuration; ``to_dict()`` is ``kvwall simulate --json``.

    Example:
        >>> r = simulate("llama-3-8b", rate=2, requests=50)
        >>> r.points[0].completed
        50
    """
    plot_path = _plot_path(plot)
    base = dict(
        model=model, rate=_check(rate, real(0, 1e6, lo_open=True), "rate"),
        concurrency=_check(concurrency, whole(1, 1 << 20), "concurrency"),
        requests=_check(requests, whole(1, 1_000_000), "requests"),
        prompt_tokens=_text(str(prompt_tokens) if isinstance(prompt_tokens, int) else prompt_tokens, "prompt_tokens"),
        output_tokens=_text(str(output_tokens) if isinstance(output_tokens, int) else output_tokens, "output_tokens"),
        dataset=_text(dataset, "dataset"), kv_memory=None if kv_memory is None else str(kv_memory),
        reserve=None if reserve is None else str(reserve),
        shared_prefix=_check(shared_prefix, whole(0, 1 << 24), "shared_prefix"),
        chunk=_check(chunk, whole(1, 1 << 20), "chunk"), max_batch=_check(max_batch, whole(1, 1 << 16), "max_batch"),
        block_size=_check(block_size, whole(1, 1 << 12), "block_size"),
        split_prefill=_flag(split_prefill, "split_prefill"), seed=_check(seed, whole(0, 2**63 - 1), "seed"),
        slo_ttft=_check(slo_ttft, seconds_arg, "slo_ttft"), slo_tpot=_check(slo_tpot, seconds_arg, "slo_tpot"),
        find_rate=_flag(find_rate, "find_rate"), kv_heads=kv_heads, window=window, weight_format=weight_format,
        kv_format=kv_format, state_format=state_format, device=_text(device, "device"), compute_dtype=compute_dtype,
        ideal=ideal, compute_eff=compute_eff, mem_eff=mem_eff, link_latency=link_latency)
    base["tp"], base["pp"], base["ep"] = _sizes(tp, pp, ep)
    if base["rate"] is not None and base["concurrency"] is not None:
        raise KvwallError("give rate or concurrency, not both")
    if base["kv_memory"] is not None and base["reserve"] is not None:
        raise KvwallError("give kv_memory (the KV pool) or reserve (what is kept free), not both")
    sweep = _sweep_items(sweep)
    if base["find_rate"] and not (base["slo_ttft"] or base["slo_tpot"]):
        raise KvwallError("--find-rate needs an SLO: give --slo-ttft and/or --slo-tpot, e.g. --slo-ttft 1s")
    if base["find_rate"] and (base["rate"] is not None or base["concurrency"] is not None
                              or _sweeps(sweep, "rate") or _sweeps(sweep, "concurrency")):
        raise KvwallError("--find-rate searches the rate itself: drop --rate / --concurrency (or --find-rate)")
    if base["rate"] is None and base["concurrency"] is None and not base["find_rate"] and not _sweeps(sweep, "rate"):
        raise KvwallError("say how requests come: --rate R (Poisson, per second), --concurrency C, or --find-rate")
    runs = [_sim_point(a, progress) for a in _grid(base, sweep)]
    points = [p for p, _ in runs]
    data = {"model": model if not isinstance(model, ModelSpec) else model.name, "device": base["device"],
            "points": points}
    if isinstance(data["model"], os.PathLike):
        data["model"] = os.fspath(data["model"])
    if plot_path:
        _sim_plot(points, runs[0][1], plot_path)
        data["plot"] = _text(plot, "plot")
    typed = tuple(SimulatePoint(
        label=p["label"], mode=p["mode"], rate=p.get("rate"), concurrency=p.get("concurrency"), tp=p["tp"],
        pp=p["pp"], ep=p["ep"], gpus=p["gpus"], completed=p.get("completed", 0), duration_s=p.get("duration_s"),
        request_throughput=p.get("request_throughput"), output_token_throughput=p.get("output_token_throughput"),
        goodput=p.get("goodput"), ttft_s=p.get("ttft_s"), tpot_s=p.get("tpot_s"),
        preemptions=p.get("preemptions", 0), kv_blocks=p["pool"]["n_blocks"]) for p in points)
    return SimulateResult(_json=_dumps(data), model=data["model"], device=base["device"], points=typed)


def _sweep_items(sweep: Any) -> list[str]:
    """A sweep as the CLI's KEY=V1,V2 items (a mapping's values may be lists)."""
    if sweep is None:
        return []
    if isinstance(sweep, Mapping):
        return [f"{k}={_list_text(v)}" for k, v in sweep.items()]
    if isinstance(sweep, str):
        return [sweep]
    return [str(s) for s in sweep]


def _sweeps(sweep: list[str], key: str) -> bool:
    return any(s.split("=", 1)[0] == key for s in sweep)


def _grid(base: dict, sweep: list[str]) -> list[dict]:
    """The option sets a sweep names (one, without it); each value parsed by the option's own rules."""
    import itertools

    axes, seen = [], set()
    for item in sweep:
        key, _, values = item.partition("=")
        if key not in SWEEPABLE or not values:
            raise KvwallError(f"bad --sweep {item!r}: write KEY=V1,V2 with KEY one of {', '.join(SWEEPABLE)}")
        if key in seen:
            raise KvwallError(f"--sweep names {key} twice; give its values once: {key}=V1,V2")
        seen.add(key)
        axes.append([(key, v) for v in dict.fromkeys(v.strip() for v in values.split(",") if v.strip())])
        if not axes[-1]:  # 'tp=,': no value, so no run at all
            raise KvwallError(f"bad --sweep {item!r}: give {key} at least one value, e.g. {key}=V1,V2")
    out = []
    for combo in itertools.product(*axes):
        a = dict(base)
        for key, value in combo:
            a[SWEEPABLE[key]] = _typed(key, value)
        if a["rate"] is not None and a["concurrency"] is not None:
            raise KvwallError("--sweep sets both a rate and a concurrency; sweep one of them")
        a["label"] = " ".join(f"{k}={v}" for k, v in combo) or "run"
        out.append(a)
    return out


def _typed(key: str, value: str):
    parse = {"rate": real(0, 1e6, lo_open=True), "concurrency": whole(1, 1 << 20)}.get(key)
    if key in ("tp", "pp", "ep", "max-batch", "chunk"):
        parse = whole(1, 1 << 20)
    if key == "shared-prefix":
        parse = whole(0, 1 << 24)
    try:
        return parse(value) if parse else value
    except argparse.ArgumentTypeError as exc:
        raise KvwallError(f"bad --sweep value {key}={value}: {exc}") from None


def _sim_point(a: dict, progress: Progress | None) -> tuple[dict, dict]:
    """One configuration: simulated at its rate or concurrency, or the largest rate that meets the SLO."""
    from kvwall import simulate as sim, workload
    from kvwall.predict.expected import describe
    from kvwall.predict.fit import parse_reserve

    spec, fm, notes = resolve(a["model"], kv_heads=a["kv_heads"], window=a["window"],
                              weight_format=a["weight_format"], kv_format=a["kv_format"],
                              state_format=a["state_format"])
    par = _parallel(a["tp"], a["pp"], a["ep"])
    roof = roof_for(spec, fm, par.group, device=a["device"], compute_dtype=a["compute_dtype"], ideal=a["ideal"],
                    compute_eff=a["compute_eff"], mem_eff=a["mem_eff"], link_latency=a["link_latency"])
    memory_bytes = roof.device.memory_bytes
    kv = parse_bytes(a["kv_memory"], "--kv-memory") if a["kv_memory"] else None
    pool = sim.kv_pool(spec, fm, par, memory_bytes, parse_reserve(a["reserve"], memory_bytes), a["block_size"],
                       a["max_batch"], kv)
    clock = sim.StepClock(spec, fm, roof, par, a["block_size"])

    def requests(rate):
        if a["dataset"]:
            reqs = workload.load_dataset(a["dataset"], a["requests"], rate, a["seed"])
        else:
            reqs = workload.stream(a["requests"], workload.parse_lengths(a["prompt_tokens"], "--prompt-tokens"),
                                   workload.parse_lengths(a["output_tokens"], "--output-tokens"), rate, a["seed"])
        reqs = workload.with_shared_prefix(reqs, a["shared_prefix"])
        sim.check_context(reqs, spec)
        return reqs

    last = {}

    def run_at(rate, concurrency=None):
        what = f"rate {rate:g}/s" if rate else f"concurrency {concurrency}"
        with (progress(f"{a['label']}: {what} ...") if progress else nullcontext(None)) as tick:
            run = sim.simulate(requests(rate), clock, pool, a["chunk"], a["max_batch"], a["split_prefill"],
                               concurrency, tick)
        last["latencies"] = {"TTFT": [r.ttft for r in run["records"]], "TPOT": [r.tpot for r in run["records"]]}
        return sim.report(run, a["slo_ttft"], a["slo_tpot"])

    out = {"label": a["label"], "model": spec.name, "device": roof.device.name, **par.as_dict(),
           "formats": fm.as_dict(), "pool": pool.as_dict(), "chunk": a["chunk"], "max_batch": a["max_batch"],
           "split_prefill": a["split_prefill"], "shared_prefix": a["shared_prefix"], "roof": describe(roof),
           "assumptions": sim.ASSUMPTIONS | roof.assumptions(), "notes": notes}
    if a["find_rate"]:
        found = sim.find_rate(run_at, a["slo_ttft"], a["slo_tpot"], *RATE_RANGE)
        out |= {"mode": "find-rate", "rate": found["rate"], "tried": found["tried"], **found["report"]}
        if found["limited_by_requests"]:
            out["notes"] = notes + [f"at higher rates the SLO held only because {a['requests']} requests all arrived "
                                    "within one median latency (a burst, not a rate): raise --requests to look further"]
    else:
        out |= {"mode": "concurrency" if a["concurrency"] else "rate", "rate": a["rate"],
                "concurrency": a["concurrency"], **run_at(a["rate"], a["concurrency"])}
    return out, last.get("latencies", {})


def _per_gpu(p: dict):
    v = p.get("output_token_throughput")
    return None if v is None else v / p["gpus"]


def _sim_plot(points: list[dict], latencies: dict, path) -> None:
    """One run: its latency CDFs and KV pool over time; a sweep: throughput per GPU against p90 TPOT."""
    from kvwall.report import plots

    p = points[0]
    if len(points) == 1:
        plots.serving(latencies, p["trace"], p["pool"]["n_blocks"],
                      f"{p['model']} on {p['device']} tp={p['tp']} ({p['label']}): simulated serving", path)
        return
    plots.pareto([{"label": p["label"], "x": (p.get("tpot_s") or {}).get("p90"), "y": _per_gpu(p)} for p in points],
                 "p90 time per output token (s)", "output tok/s per GPU",
                 f"{points[0]['model']} on {points[0]['device']}: throughput per GPU against latency", path)


# -- validate ----------------------------------------------------------------------------------------------------

def validate(*, engine: str | None = None, device: str | None = None, mode: str = "expected", fit: bool = False,
             out: str | os.PathLike | None = None, plot: str | os.PathLike | None = None) -> ValidateResult:
    """Predictions against the published measurements in catalog/measurements.json (``kvwall validate``).

    Both modes are scored for every row: ideal, and expected leave-one-out (each row predicted by a fit made
    without it) and leave-one-source-out (by a fit made without its source document). Scoring the whole table
    takes a few minutes.

    Args:
        engine: Only this engine's rows (gpt-fast, TensorRT-LLM, ...).
        device: Only this device's rows (a100-80gb, h100-sxm, ...).
        mode: The mode whose errors the summary and each row's ``predicted`` / ``error`` show: "expected" or "ideal".
        fit: Refit expected mode on the whole table first and save it where expected mode reads it
            ($KVWALL_HOME/efficiency.json, else ~/.cache/kvwall/efficiency.json), or to ``out``.
        out: With fit: write the fitted table here instead.
        plot: Write predicted against measured, log-log, both modes, here.

    Returns:
        ValidateResult: the errors of ``mode``; ``to_dict()`` is ``kvwall validate --json``.

    Example:
        >>> r = validate(engine="gpt-fast", mode="ideal")   # doctest: +SKIP
        >>> r.median_abs_error < 0.5                         # doctest: +SKIP
        True
    """
    from kvwall.files import write_text
    from kvwall.predict import validate as _pv

    plot_path = _plot_path(plot)
    engine, device, out = _text(engine, "engine"), _text(device, "device"), _text(out, "out")
    mode = _choice(mode, VALIDATE_MODES, "mode")
    fit = _flag(fit, "fit")
    if out is not None and not fit:
        raise KvwallError("--out names where --fit writes its table; add --fit, or drop --out")
    _pv.select(catalog.measurements(), engine, device)  # an unknown engine or device: one line, now
    target = _fit_target(out) if fit else None
    if target:
        write_text(target, _pv.dumps(_pv.refit(catalog.measurements())))
    data = _pv.validate(catalog.measurements(), engine, device, mode)
    if target:
        data["fit_written"] = str(target)
    if plot_path:
        _validate_plot(data["rows"], plot_path)
        data["plot"] = _text(plot, "plot")
    s = (data.get("summaries") or {}).get(mode) or {}
    every = s.get("all") or {}
    by_source = ((data.get("summaries") or {}).get("expected_loso") or {}).get("all") or {}
    return ValidateResult(_json=_dumps(data), mode=mode, rows=len(data["rows"]), checked=s.get("checked", 0),
                          skipped=s.get("skipped", 0), median_abs_error=every.get("median_abs_error"),
                          median_error=every.get("median_error"), max_abs_error=every.get("max_abs_error"),
                          worst=every.get("worst"), fit_written=data.get("fit_written"),
                          loso_median_abs_error=by_source.get("median_abs_error"))


def _fit_target(out: str | None) -> Path:
    """Where fit writes: ``out``, else the user's table; checked now, and never over a file that is not a table."""
    from kvwall.files import check_output, refuse_unless_ours

    path = check_output(out if out is not None else catalog.user_efficiency_file(), (".json",),
                        option="--out" if out is not None else "the fitted table's path", make_parents=out is None,
                        what="the fitted table")
    refuse_unless_ours(path, _is_fit, "a kvwall fitted efficiency table", own=catalog.user_efficiency_file)
    return path


def _is_fit(data: object) -> bool:
    """Whether parsed JSON is a fitted table (predict.validate.refit's shape): an object with its params."""
    return isinstance(data, dict) and isinstance(data.get("params"), dict) and "table_version" in data


def _validate_plot(rows: list[dict], path) -> None:
    """Rates on both axes (1 / time for TPOT and TTFT), so that above the line = prediction faster."""
    from kvwall.predict.expected import MODES
    from kvwall.predict.validate import TIME_METRICS
    from kvwall.report import plots

    rate = lambda r, v: 1 / v if r["metric"] in TIME_METRICS else v  # noqa: E731
    points = [{"group": r["engine"], "mode": m, "measured": rate(r, r["measured"]),
               "predicted": rate(r, r[m]["predicted"])} for r in rows if "error" in r for m in MODES]
    plots.versus(points, "measured (tok/s; 1/s for TPOT and TTFT rows)", "predicted (same unit)",
                 "kvwall against published measurements: filled = expected (leave-one-out), hollow = ideal "
                 "roofline; above the line: prediction faster", path)
