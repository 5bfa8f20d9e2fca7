"""The report's measured section: `kvwall bench` on this machine, next to the roofline's prediction."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from pathlib import Path

from kvwall.report.document import Figure, Section, Table
from kvwall.units import fmt_bytes, fmt_tokens

QUICK = {"contexts": [1024, 4096], "steps": 4, "prefill_max": 1024}  # the default: a few archs, two contexts
FULL = {"contexts": [1024, 4096, 16384, 32768], "steps": 8, "prefill_max": 4096}  # --full: every arch


def plan(full: bool = False, say=None):
    """(plan, device, estimated seconds) of the measured section; calibrates first when the profile is stale."""
    from kvwall.measure import bench

    settings = FULL if full else QUICK
    device = bench.local_profile(say)
    p = bench.Plan(bench.resolve_archs([], not full), settings["contexts"], steps=settings["steps"],
                   prefill_max=settings["prefill_max"])
    return p, device, bench.estimate_seconds(p, device) + (REAL_SECONDS if real_model_installed() else 0)


def calibration_provenance(report_started: datetime.datetime) -> str:
    """Which calibration of this machine the predictions used, with its date: one made for this report, or one
    reused from an earlier run (a profile under a day old is reused: kvwall.measure.calibrate.FRESH_S)."""
    from kvwall.predict.devices import profile_path

    try:
        when = datetime.datetime.fromisoformat(json.loads(profile_path().read_text())["measured"]["date"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"predictions from the `local` profile at {profile_path()}, which records no calibration date"
    when = when if when.tzinfo else when.astimezone()  # a date without its zone: this machine's local time
    date = when.strftime("%Y-%m-%d %H:%M %Z").strip()
    if when >= report_started:
        return f"predictions from the calibration of {date}, made for this report"
    hours = (report_started - when).total_seconds() / 3600
    return f"predictions from the calibration of {date}, reused from an earlier run ({hours:.1f} h before this report)"


def section(out: Path, plan_device, progress=None, report_started: datetime.datetime | None = None) -> Section:
    from kvwall.measure import bench

    plan, device = plan_device
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    report_started = report_started or datetime.datetime.now().astimezone()
    t0 = time.time()
    results = bench.run(plan, device)
    s = bench.summary(results)
    fig = out / "measured-vs-predicted.png"
    plot_results(results, device, fig)
    rows = [[r["arch"], fmt_tokens(r["context"]), f"{r['decode_s'] * 1e3:.1f}", f"{r['decode_pred_s'] * 1e3:.1f}",
             f"{r['decode_error'] * 100:+.0f}%", r["decode_bound"], fmt_bytes(r["cache_bytes"]),
             fmt_bytes(r["cache_pred_bytes"]), fmt_bytes(r["peak_rss_bytes"])] for r in results]
    where = (f"Measured on {platform.node()} ({os.cpu_count()} cores, {platform.machine()}) on {started}, in "
             f"{time.time() - t0:.0f} s; calibrated read bandwidth {device.bandwidth / 1e9:.1f} GB/s, engine dispatch "
             f"cost {device.layer_overhead_s * 1e3:.2f} ms per layer per step (profile: {device.source}).")
    verdict = (f"{s['within_goal']} of {s['bandwidth_bound_points']} bandwidth-bound points are within "
               f"{s['goal'] * 100:.0f}% of the prediction." +
               (f" Outside: {', '.join(s['outside_goal'])}." if s["outside_goal"] else ""))
    reasons = [f"Why {arch} is outside: {why}." for arch, why in s["reasons"].items()]
    skipped = [f"skipped {k['arch']}" + (f" @ {fmt_tokens(k['context'])}" if k.get("context") else "")
               + f": {k['reason']}" for k in plan.skipped]
    real = real_model_table(device)
    return Section(
        "Measured on this machine",
        provenance=f"measured in this run on {started}; {calibration_provenance(report_started)}",
        paragraphs=[where, verdict, *reasons, *skipped],
        tables=([real] if real else []) + [Table(["arch", "context", "decode ms", "predicted ms", "error",
                                                  "predicted bound", "cache", "predicted cache", "peak RSS"], rows,
                                                 "decode: median of the timed steps after warm-up; "
                                                 "error = predicted / measured - 1")],
        figures=[Figure(fig, "Measured (solid) vs predicted (dashed) decode time per token vs context, per "
                             "architecture", "measured-vs-predicted")],
        assumptions=["random weights, fp32, batch 1, matched size (121.1-144.5M parameters)",
                     "prediction: expected mode on the `local` profile, i.e. its calibration (measured streaming "
                     "bandwidth and GEMM rate, plus the engine's measured per-layer dispatch cost)",
                     "contexts above the prefill limit are filled with random K/V through the cache's own update()"],
    )


REAL_MODEL = "smollm2-135m"  # the trained model the section runs when its package is installed
REAL_SECONDS = 40  # loading it twice (kvwall, transformers) and 2 x 6 steps at batch 1 and 16, on 2 cores


def real_model_installed() -> bool:
    import importlib.util

    from kvwall.spec.gguf_meta import PACKAGED

    return importlib.util.find_spec(PACKAGED[REAL_MODEL].module) is not None


def real_model_table(device) -> Table | None:
    """SmolLM2-135M (when installed): kvwall's decode against transformers on the same weights, batch 1 and 16,
    steps taken in turn in one process, next to the roofline on the local profile; None without the package."""
    from kvwall.measure import bench, real_bench

    if not real_model_installed():
        return None
    plan = real_bench.RealPlan(bench.resolve_archs([REAL_MODEL], quick=True), caches=["contiguous"], steps=4)
    rows = real_bench.run(plan, device)
    body = [[r["arch"], r["batch"], r["engine"], f"{r['tok_s']:.1f}",
             f"{r['vs_transformers']:.2f}x" if r.get("vs_transformers") else "-",
             f"{r['pred_tok_s']:.1f}" if r.get("pred_tok_s") else "-"] for r in rows]
    return Table(["model", "batch", "engine", "tok/s", "vs transformers", "predicted tok/s"], body,
                 f"a trained model: {REAL_MODEL} in fp32, 16-token prompt, greedy; median of the timed steps, kvwall "
                 "and transformers taking steps in turn in one process")


def plot_results(results: list[dict], device, path: str | Path) -> Path:
    """Measured (solid) and predicted (dashed) decode time vs context, one colour per architecture."""
    from kvwall.report import plots

    series, dashed = {}, set()
    for r in results:
        series.setdefault(r["arch"], []).append((r["context"], r["decode_s"] * 1e3))
        key = f"{r['arch']} (predicted)"
        series.setdefault(key, []).append((r["context"], r["decode_pred_s"] * 1e3))
        dashed.add(key)
    return plots.lines(series, "context (tokens)", "decode time per token (ms)",
                       f"Measured (solid) vs predicted (dashed) decode time on this machine "
                       f"({device.bandwidth / 1e9:.0f} GB/s)", path, logy=True, dashed=dashed)


def plot_loadtest(data: dict, path: str | Path) -> Path:
    """Latency CDFs of a loadtest (kvwall.measure.loadtest.summarize): TTFT, TPOT and end-to-end, in ms."""
    from kvwall.report import plots

    ok = [s for s in data["samples"] if s["ok"]]
    tpot = [(s["e2e"] - s["ttft"]) / (s["output_tokens"] - 1) for s in ok if s["output_tokens"] > 1]
    series = {}
    for label, values in (("TTFT", [s["ttft"] for s in ok]), ("TPOT", tpot), ("end to end", [s["e2e"] for s in ok])):
        values = sorted(v * 1e3 for v in values)
        series[label] = [(v, (i + 1) / len(values)) for i, v in enumerate(values)]
    return plots.lines(series, "latency (ms)", "fraction of requests at or below",
                       f"{data['model']} at {data['url']} ({data['mode']}, {data['completed']} requests)", path)


def plot_sweep(data: dict, path: str | Path) -> Path:
    """A loadtest sweep: output-token throughput (left) and p99 end-to-end latency (right) against the load."""
    from kvwall.report import plots

    pts = [p for p in data["points"] if p["e2e_s"]]
    return plots.two_axes([p["load"] for p in pts], ("output tokens/s", [p["output_token_throughput"] for p in pts]),
                          ("p99 end-to-end latency (s)", [p["e2e_s"]["p99"] for p in pts]),
                          f"offered load ({data['sweep']})", f"{data['model']} at {data['url']}", path)
