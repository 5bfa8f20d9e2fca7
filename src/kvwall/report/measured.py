"""The report's measured section: `kvwall bench` on this machine, next to the roofline's prediction."""

from __future__ import annotations

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
    return p, device, bench.estimate_seconds(p, device)


def section(out: Path, plan_device, progress=None) -> Section:
    from kvwall.measure import bench

    plan, device = plan_device
    started = time.strftime("%Y-%m-%d %H:%M %Z")
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
    return Section(
        "Measured on this machine",
        paragraphs=[where, verdict, *reasons, *skipped],
        tables=[Table(["arch", "context", "decode ms", "predicted ms", "error", "predicted bound", "cache",
                       "predicted cache", "peak RSS"], rows,
                      "decode: median of the timed steps after warm-up; error = predicted / measured - 1")],
        figures=[Figure(fig, "Measured (solid) vs predicted (dashed) decode time per token vs context, per "
                             "architecture", "measured-vs-predicted")],
        assumptions=["random weights, fp32, batch 1, matched size (121.1-144.5M parameters)",
                     "prediction: expected mode on the `local` profile, i.e. its calibration (measured streaming bandwidth and GEMM rate, plus the "
                     "engine's measured per-layer dispatch cost)",
                     "contexts above the prefill limit are filled with random K/V through the cache's own update()"],
    )


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
