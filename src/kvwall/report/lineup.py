"""The report's 2025–26 lineup: the newest answers to the memory wall, each model in its own weight format.

Every number comes from the predictor in this run. What each mechanism buys is computed, not written: the cache
a model holds at 1M tokens against the same model with every layer keeping every token the way its full-attention
layers do, and what a decode step reads against what the cache holds (DSA's top-k, a chunk).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kvwall import catalog
from kvwall.predict import mixers
from kvwall.predict.devices import get_device
from kvwall.predict.fit import placement
from kvwall.predict.memory import (
    Formats,
    cache_bytes_per_token,
    memory,
    state_bytes,
    token_bytes,
    tokens_held,
)
from kvwall.predict.ops import step_ops
from kvwall.predict.step import Step
from kvwall.report import plots
from kvwall.report.analysis import CONTEXTS, DEVICES, PREDICTED, longest_fitting
from kvwall.report.document import Figure, Section, Table
from kvwall.spec.model import ModelSpec
from kvwall.spec.resolve import load_spec
from kvwall.units import fmt_bytes

LONG, MILLION = 131072, 1 << 20


def mechanism(spec: ModelSpec) -> str:
    """The layer kinds and how many of each, e.g. '36 gated_deltanet + 12 attention' (the predictor's labels)."""
    kinds = Counter(mixers.of(layer.mixer).label(layer.mixer) for layer in spec.layers if layer.mixer is not None)
    return " + ".join(f"{n} {kind}" for kind, n in kinds.most_common())


def _group(spec: ModelSpec, fm: Formats, device: str, context: int) -> str:
    """The smallest tensor-parallel group of `device` holding the weights and one sequence at `context`."""
    p = placement(spec, get_device(device).memory_bytes, batch=1, context=context, formats=fm)
    return f"tp {p.tp}" if p.fits else "does not fit 8"


def all_full_bytes(spec: ModelSpec, fm: Formats, context: int) -> int | None:
    """One sequence's cache at `context` if every layer kept every token the way the model's full layers do (their
    average bytes per token, times every layer); None when no layer keeps every token."""
    full = [token_bytes(layer, fm.kv) for layer in spec.layers
            if layer.mixer is not None and tokens_held(layer, context) == context and token_bytes(layer, fm.kv)]
    return sum(full) * spec.n_layers * context // len(full) if full else None


def decode_reads(spec: ModelSpec, fm: Formats, context: int) -> tuple[int, int]:
    """(cache bytes one decode step at `context` reads, cache bytes the sequence holds), on one GPU, batch 1."""
    ops = step_ops(spec, Step(1, context - 1, 1), fm)
    held = sum(token_bytes(layer, fm.kv) * tokens_held(layer, context) for layer in spec.layers)
    return int(sum(op.cache_read for op in ops)), held


def buys(spec: ModelSpec, fm: Formats) -> str:
    """One sentence on what the model's mechanism buys, computed from the predictor."""
    at_1m = memory(spec, context=MILLION, formats=fm).cache_bytes
    full = all_full_bytes(spec, fm, MILLION)
    s = f"{spec.name} ({mechanism(spec)}): at 1M tokens one sequence holds {fmt_bytes(at_1m)}"
    if full is None:
        s += "."
    elif full > 1.05 * at_1m:
        s += (f", {full / at_1m:,.1f}x less than the {fmt_bytes(full)} it would hold if every layer kept every "
              "token as its full-attention layers do.")
    else:
        fixed = state_bytes(spec, fm.state)
        s += (" as every layer keeps every token" + (f" (plus a fixed {fmt_bytes(fixed)} state)." if fixed else "."))
    reads, held = decode_reads(spec, fm, LONG)
    if held and reads < 0.8 * held:
        s += (f" A decode step at 128k reads {fmt_bytes(reads)} of the {fmt_bytes(held)} its cache holds "
              f"({held / reads:,.1f}x less).")
    return s


def section(out: Path) -> Section:
    specs = [load_spec(name) for name in catalog.LINEUP_2025]
    rows, series, sentences = [], {}, []
    for spec in specs:
        fm = Formats.for_spec(spec)
        w = memory(spec, context=1, formats=fm)
        rows.append([spec.name, mechanism(spec), f"{fmt_bytes(w.weight_bytes)} {fm.weights.name}",
                     fmt_bytes(cache_bytes_per_token(spec, fm.kv)), fmt_bytes(state_bytes(spec, fm.state)),
                     fmt_bytes(memory(spec, context=LONG, formats=fm).cache_bytes),
                     fmt_bytes(memory(spec, context=MILLION, formats=fm).cache_bytes),
                     *[_group(spec, fm, d, c) for d in DEVICES for c in (LONG, MILLION)],
                     longest_fitting(spec, fm, get_device("h200").memory_bytes)])
        series[spec.name] = [(c, memory(spec, context=c, formats=fm).cache_bytes / 2**30) for c in CONTEXTS]
        sentences.append(buys(spec, fm))
    fig = plots.lines(series, "context (tokens)", "cache and state for one sequence (GiB)",
                      "The 2025-26 lineup: cache memory vs context (batch 1); the dotted line is one 80 GB GPU",
                      out / "cache-vs-context-2025.png", logy=True, hline=(80e9 / 2**30, "80 GB"))
    cols = ["model", "layers", "weights (own format)", "cache/token", "fixed state", "cache @128k", "cache @1M",
            *[f"{d} @{c}" for d in DEVICES for c in ("128k", "1M")], "longest ctx on h200"]
    return Section(
        "The 2025-26 lineup: new ways past the wall",
        paragraphs=["The models released since the source documents, each sized in the weight format its "
                    "checkpoint ships in (quantization_config) and placed on the smallest tensor-parallel group "
                    "(1, 2, 4 or 8 GPUs) that holds its weights and one sequence. What each mechanism buys:",
                    *sentences],
        tables=[Table(cols, rows, "cache/token: while every layer keeps the token (windows and chunks not yet "
                                  "full); a device column: the smallest group holding one sequence at that context")],
        figures=[Figure(fig, "The 2025-26 lineup: cache and state for one sequence vs context",
                        "cache-vs-context-2025")],
        assumptions=["weights in each checkpoint's own format; KV cache and recurrent state in each model's 16-bit "
                     "type (DSA's indexer keys as DeepSeek stores them)",
                     "10 % of each GPU's memory kept in reserve for activations and runtime",
                     "contexts past a model's trained maximum are what-ifs of its architecture"],
        provenance=PREDICTED,
    )
