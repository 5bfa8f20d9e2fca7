"""The report's catalog analysis: every number comes from the predictor, in this run."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvwall import catalog
from kvwall.predict.devices import balance_trend, get_device
from kvwall.predict.expected import expected_roof
from kvwall.predict.fit import longest_on_group, placement
from kvwall.predict.memory import Formats, Parallel, cache_bytes_per_token, growth_bytes_per_token, memory, state_bytes
from kvwall.predict.roofline import PhaseResult, Roof, decode, prefill
from kvwall.report import plots
from kvwall.report.document import Figure, Section, Table
from kvwall.spec.resolve import load_spec
from kvwall.units import fmt_bytes, fmt_tokens

DEVICES = ["h100-sxm", "h200", "b200"]
PREDICTED = "computed in this run by kvwall's predictor from the catalog's model configs; nothing measured"
CONTEXTS = [1 << k for k in range(10, 21)]  # 1k .. 1M


def _specs():
    return [(name, load_spec(name)) for name in catalog.LINEUP]


def memory_section(out: Path) -> Section:
    specs = _specs()
    rows = []
    for _, spec in specs:
        fm = Formats.for_spec(spec)
        longest = [longest_fitting(spec, fm, get_device(d).memory_bytes) for d in DEVICES]
        rows.append([spec.name, spec.family(), fmt_bytes(cache_bytes_per_token(spec, fm.kv)),
                     fmt_bytes(growth_bytes_per_token(spec, fm.kv)), fmt_bytes(state_bytes(spec, fm.state)),
                     fmt_bytes(memory(spec, context=131072, formats=fm).cache_bytes), *longest])
    avg = {spec.name: memory(spec, context=131072).cache_bytes / 131072 for _, spec in specs}
    fig1 = plots.bars(list(avg), list(avg.values()), "cache bytes per token (average over 128k tokens)",
                      "What one token of context costs, GPT-2 XL to Mamba (batch 1, 16-bit cache)",
                      out / "cache-per-token.png", logy=True)
    series = {spec.name: [(c, memory(spec, context=c).cache_bytes / 2**30) for c in CONTEXTS] for _, spec in specs}
    fig2 = plots.lines(series, "context (tokens)", "cache for one sequence (GiB)",
                       "Cache memory vs context (batch 1, 16-bit); the dotted line is one 80 GB GPU",
                       out / "cache-vs-context.png", logy=True, hline=(80e9 / 2**30, "80 GB"))
    return Section(
        "Memory: what remembering the context costs",
        paragraphs=["Per-token cache bytes, fixed state and the longest context that fits next to the weights "
                    "on one GPU, for the lineup of the source documents."],
        tables=[Table(["model", "family", "cache/token", "past windows", "fixed state", "cache @128k",
                       *[f"longest ctx on {d}" for d in DEVICES]], rows,
                      "cache/token: while every layer keeps the token; past windows: once sliding layers are full")],
        figures=[Figure(fig1, "Average cache bytes per token at 128k context (log scale)", "cache-per-token"),
                 Figure(fig2, "Cache memory vs context, log-log, against one 80 GB GPU", "cache-vs-context")],
        assumptions=["KV cache and SSM state in each model's 16-bit type; weights in each checkpoint's own format "
                     "(its quantization_config: DeepSeek-V3 in block-wise FP8, the others 16-bit)",
                     "10 % of each GPU's memory kept in reserve for activations and runtime",
                     "contexts past a model's trained maximum are what-ifs of its architecture"],
        provenance=PREDICTED,
    )


def speed_section(out: Path) -> Section:
    specs = _specs()
    h100 = get_device("h100-sxm")
    series, marks, rows = {}, {}, []
    for _, spec in specs:
        fm = Formats.for_spec(spec)
        series[spec.name] = [(c, _decode_s(spec, fm, h100, c) * 1e3) for c in CONTEXTS if _par(spec, fm, h100, c)]
        marks[spec.name] = group_changes(spec, fm, h100, series[spec.name])
        cells = [_tok_s(spec, fm, get_device(d), c) for d in DEVICES for c in (4096, 131072)]
        par = _par(spec, fm, h100, 2048)
        ttft = (f"{prefill(spec, 2048, 1, fm, _roof(spec, fm, h100, par), par).time_s * 1e3:,.1f}{_on(par)}"
                if par else "does not fit 8")
        rows.append([spec.name, ttft, *cells])
    fig = plots.lines(series, "context (tokens)", "decode time per token (ms)",
                      "The memory wall on H100: expected decode time vs context (batch 1); "
                      "ringed: the model moves to a larger tensor-parallel group",
                      out / "decode-vs-context.png", logy=True, marks=marks)
    roof = Roof(h100)  # the chart draws the ideal roof: the ceiling each op sits under
    llama = load_spec("llama-3-8b")
    pts = roofline_points((prefill(llama, 2048, 8, Formats.for_spec(llama), roof),
                           decode(llama, 4096, 8, Formats.for_spec(llama), roof)), first_layer=True)
    fig2 = plots.roofline(pts, roof.peak, roof.bandwidth, "Llama-3-8B on H100, batch 8: each op under the roof",
                          out / "roofline.png")
    cols = ["model", "TTFT 2k on H100 (ms)"] + [f"{d} tok/s @{fmt_tokens(c)}" for d in DEVICES for c in (4096, 131072)]
    return Section(
        "Speed: decode is bandwidth-bound",
        paragraphs=["Expected-mode predictions: each op takes max(FLOPs / peak, bytes / bandwidth) at the "
                    "fractions of peak and the fixed costs fitted to published measurements (kvwall validate "
                    "scores them leave-one-out; `kvwall speed --ideal` gives the ideal bound). Attention lines rise "
                    "with context, Mamba stays flat, local/global and hybrid models rise slowly."],
        tables=[Table(cols, rows, "tokens/s per sequence at batch 1, expected mode")],
        figures=[Figure(fig, "Expected decode time per token vs context on H100", "decode-vs-context"),
                 Figure(fig2, "Ideal roofline: Llama-3-8B's ops (first layer, embeddings, LM head) at batch 8",
                        "roofline")],
        assumptions=["expected mode: fitted fractions of the datasheet peaks and fixed costs "
                     "(catalog/efficiency.json); the roofline chart alone is ideal (efficiency 1.0)",
                     "bf16 math; ops do not overlap; MLA decode in absorbed form; MoE reads the experts a step "
                     "touches", "each model runs on the smallest tensor-parallel group (1, 2, 4 or 8 GPUs, shown as "
                     "'tp N') that holds its weights and the sequence's cache with 10 % in reserve; 'does not fit "
                     "8' where 8 GPUs are not enough", "tok/s is per sequence; with tp > 1 each step also pays the "
                     "all-reduces over the device's interconnect"],
        provenance=f"{PREDICTED}; {fit_provenance()}",
    )


def fit_provenance() -> str:
    """Where expected mode's fitted figures come from, and the date of that fit."""
    return (f"expected mode's fitted figures of {catalog.efficiency().get('date', 'an unknown date')} "
            f"({catalog.efficiency_source()})")


def _par(spec, fm, device, context: int) -> Parallel | None:
    """The smallest tensor-parallel group of this device that holds the weights and one sequence's cache."""
    p = placement(spec, device.memory_bytes, batch=1, context=context, formats=fm)
    return Parallel(p.tp) if p.fits else None


def _roof(spec, fm, device, par: Parallel) -> Roof:
    return expected_roof(device, "bf16", fm, spec, par.tp)


def _decode_s(spec, fm, device, context: int) -> float:
    par = _par(spec, fm, device, context)
    return decode(spec, context, 1, fm, _roof(spec, fm, device, par), par).time_s


def group_changes(spec, fm, device, points: list[tuple[int, float]]) -> list[tuple[int, float, str]]:
    """The points where the smallest group that holds the model grows (a saw-tooth in decode time: more GPUs
    share the weight reads), each with its new group, e.g. (32768, 11.2, 'tp 2')."""
    out, before = [], None
    for c, y in points:
        tp = _par(spec, fm, device, c).tp
        if before is not None and tp != before:
            out.append((c, y, f"tp {tp}"))
        before = tp
    return out


def _on(par: Parallel) -> str:
    return f" (tp {par.tp})" if par.tp > 1 else ""


def _tok_s(spec, fm, device, context: int) -> str:
    par = _par(spec, fm, device, context)
    return f"{1 / _decode_s(spec, fm, device, context):,.1f}{_on(par)}" if par else "does not fit 8"


def longest_fitting(spec, fm, memory_bytes: int) -> str:
    """Longest context for batch 1 on the smallest tensor-parallel group that holds the weights."""
    p, f = longest_on_group(spec, memory_bytes, 1, fm)
    if not p.fits:
        return "weights do not fit 8"
    return ("any" if f.unbounded else f"{f.max_context:,}") + (f" (tp {p.tp})" if p.tp > 1 else "")


def balance_section(out: Path) -> Section:
    trend = balance_trend()
    rows = [[r["device"], r["year"], f"{r['flops'] / 1e12:,.0f}", f"{r['bandwidth'] / 1e9:,.0f}",
             f"{r['balance']:,.0f}"] for r in trend]
    labels = [f"{r['device']}\nbalance {r['balance']:.0f}" for r in trend]
    growth = {"16-bit peak FLOP/s": [r["flops_growth"] for r in trend],
              "memory bandwidth": [r["bandwidth_growth"] for r in trend]}
    fig = plots.grouped_bars(labels, growth, "growth since V100",
                             "Compute grows faster than bandwidth (machine balance in FLOP/B under each name)",
                             out / "balance.png")
    return Section(
        "Hardware: compute outgrows bandwidth",
        paragraphs=["Machine balance (FLOP per byte at which a kernel is neither compute- nor memory-bound) "
                    "across NVIDIA generations; decode runs at about 1 FLOP per byte."],
        tables=[Table(["device", "year", "16-bit TFLOP/s", "GB/s", "balance FLOP/B"], rows,
                      "dense peaks from the device catalog (V100: fp16 tensor; others bf16)")],
        figures=[Figure(fig, "Growth of 16-bit compute and memory bandwidth since V100", "balance")],
        provenance="the device catalog's datasheet peaks, read in this run; nothing measured",
    )


def group_ops(per_op: list[dict]) -> list[dict]:
    """Sum ops of the same name across layers (the experts of every MoE layer under one name)."""
    groups: dict[str, dict] = {}
    for op in per_op:
        key = op["name"].split(" (")[0] if op["name"].startswith("experts") else op["name"]
        g = groups.setdefault(key, {"name": key, "count": 0, "flops": 0.0, "bytes": 0.0, "time_s": 0.0,
                                    "bounds": set()})
        g["count"] += 1
        g["flops"] += op["flops"]
        g["bytes"] += op["bytes"]
        g["time_s"] += op["time_s"]
        g["bounds"].add(op["bound"])
    out = []
    for g in groups.values():
        g["intensity"] = g["flops"] / g["bytes"] if g["bytes"] else None
        g["bound"] = "/".join(sorted(g.pop("bounds")))
        out.append(g)
    return out


def roofline_points(phases: Iterable[PhaseResult], first_layer: bool = False) -> list[dict]:
    """Points for plots.roofline: each op's intensity and achieved FLOP/s, per phase.

    Ops summed over layers, or (``first_layer``) only the first layer's ops and those outside the layers."""
    points = []
    for ph in phases:
        ops = [op for op in ph.per_op if op["layer"] in (0, None)] if first_layer else group_ops(ph.per_op)
        for op in ops:
            if op["flops"] and op["bytes"] and op["time_s"]:
                points.append({"label": op["name"], "intensity": op["intensity"],
                               "flops_per_s": op["flops"] / op["time_s"], "phase": ph.name})
    return points
