"""`kvwall bench`: every strategy on this machine, measured next to its prediction."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from kvwall.commands import common
from kvwall.errors import KvwallError
from kvwall.report.tables import console, print_json, table
from kvwall.units import fmt_bytes, fmt_tokens, parse_token_list, parse_tokens, whole

DEFAULT_CONTEXTS = "1k,4k,16k,32k"
QUICK_CONTEXTS = "1k,4k"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark architectures on this machine against the roofline prediction")
    p.add_argument("archs", nargs="*", help="architectures (default: all; see --list) or model directories")
    p.add_argument("--list", action="store_true", help="list the architectures and exit")
    p.add_argument("--context", help=f"contexts (default {DEFAULT_CONTEXTS}; --quick: {QUICK_CONTEXTS})")
    p.add_argument("--steps", type=whole(1), default=8, help="timed decode steps per point (median; default 8)")
    p.add_argument("--prefill-max", default="4k", help="time a real prefill up to this context (default 4k)")
    p.add_argument("--quick", action="store_true", help="fewer architectures and contexts (about a minute)")
    p.add_argument("--threads", type=whole(1, 1 << 16), help="torch threads (default: all cores)")
    p.add_argument("--plot", metavar="PNG", help="measured vs predicted decode time vs context")
    p.add_argument("--save", metavar="JSON", help="also write the results to this file")
    common.add_json(p)
    p.set_defaults(func=cmd_bench)


def resolve_archs(names: list[str], quick: bool):
    from kvwall.measure.archs import ARCHS, DEFAULT, QUICK, checkpoint_arch

    out = []
    for name in names or (QUICK if quick else DEFAULT):
        if name in ARCHS:
            out.append(ARCHS[name])
        elif Path(name).is_dir():
            out.append(checkpoint_arch(name))
        else:
            raise KvwallError(f"unknown architecture {name!r}; known: {', '.join(ARCHS)}, or a model directory")
    return out


def local_profile(quiet: bool):
    """The `local` device; calibrates first (quick) when this machine has no profile yet."""
    from kvwall.predict.devices import local_device, profile_path

    if not profile_path().is_file():
        from kvwall.measure.calibrate import calibrate, save_profile

        if not quiet:
            console().print(f"no profile of this machine at {profile_path()}: running `kvwall calibrate --quick` first")
        save_profile(calibrate(quick=True).profile(), profile_path())
    return local_device()


def cmd_bench(args) -> int:
    from kvwall.measure.archs import ARCHS

    if args.list:
        rows = [[a.name, a.cache, a.about] for a in ARCHS.values()]
        if args.json:
            print_json([{"name": r[0], "cache": r[1], "about": r[2]} for r in rows])
        else:
            console().print(table("bench architectures (~120-145M parameters, random weights)",
                                  ["name", "cache", "what"], rows))
        return 0
    common.need_torch("kvwall bench runs the engine")
    if args.steps < 1:
        raise KvwallError("--steps must be at least 1")
    from kvwall.measure import bench

    archs = resolve_archs(args.archs, args.quick)
    contexts = sorted(set(parse_token_list(args.context or (QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS))))
    plan = bench.Plan(archs, contexts, steps=args.steps, prefill_max=parse_tokens(args.prefill_max, "prefill max"),
                      threads=args.threads)
    device = local_profile(args.json)
    started = time.time()
    results = _run_with_progress(plan, device, quiet=args.json)
    data = {"machine": {"host": platform.node(), "cpu_count": os.cpu_count(), "bandwidth_Bps": device.bandwidth,
                        "peak_flops": device.peak_flops, "profile_source": device.source},
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": round(time.time() - started, 1),
            "steps": plan.steps, "results": results, "skipped": plan.skipped, "summary": bench.summary(results, archs)}
    if args.save:
        _write_json(Path(args.save), data)
    if args.plot:
        plot_results(results, device, args.plot)
        data["plot"] = args.plot
    if args.json:
        print_json(data)
    else:
        print_results(data)
    return 0


def _run_with_progress(plan, device, quiet: bool) -> list[dict]:
    from rich.progress import Progress

    from kvwall.measure import bench

    total = len(plan.archs) * len(plan.contexts)
    with Progress(console=console(), transient=True, disable=quiet) as progress:
        task = progress.add_task("bench", total=total)

        def on_point(r):
            progress.update(task, advance=1, description=f"{r['arch']} @ {fmt_tokens(r['context'])}")

        results = bench.run(plan, device, on_point)
    return results


def print_results(data: dict) -> None:
    c = console()
    m = data["machine"]
    c.print(f"this machine ({m['host']}, {m['cpu_count']} cores): calibrated read bandwidth "
            f"{m['bandwidth_Bps'] / 1e9:.1f} GB/s; decode = median of {data['steps']} steps; took {data['seconds']} s")
    rows = []
    for r in data["results"]:
        pf = f"{r['prefill_s']:.2f} / {r['prefill_pred_s']:.2f}" if r.get("prefill_s") else "-"
        rows.append([r["arch"], fmt_tokens(r["context"]), f"{r['decode_s'] * 1e3:.1f}", f"{r['decode_pred_s'] * 1e3:.1f}",
                     f"{r['decode_error'] * 100:+.0f}%", r["decode_bound"], pf, fmt_bytes(r["cache_bytes"]),
                     fmt_bytes(r["cache_pred_bytes"]), fmt_bytes(r["peak_rss_bytes"])])
    if rows:
        c.print(table("decode per token: measured vs predicted (roofline on the local profile)",
                      ["arch", "ctx", "ms", "pred ms", "error", "pred bound", "prefill s (meas/pred)", "cache",
                       "pred cache", "peak RSS"], rows,
                      caption="error = predicted / measured - 1; cache = the engine cache's own byte count"))
    s = data["summary"]
    if s["bandwidth_bound_points"]:
        c.print(f"{s['within_goal']} of {s['bandwidth_bound_points']} bandwidth-bound points within "
                f"{s['goal'] * 100:.0f}%" + (f"; outside: {', '.join(s['outside_goal'])}" if s["outside_goal"] else ""))
        for arch, why in s["reasons"].items():
            c.print(f"  {arch}: {why}")
    for sk in data["skipped"]:
        where = f" @ {fmt_tokens(sk['context'])}" if sk.get("context") else ""
        c.print(f"skipped {sk['arch']}{where}: {sk['reason']}")
    if data.get("plot"):
        c.print(f"plot written to {data['plot']}")


def plot_results(results: list[dict], device, path: str) -> None:
    from kvwall.report import plots

    series, dashed = {}, set()
    for r in results:
        series.setdefault(r["arch"], []).append((r["context"], r["decode_s"] * 1e3))
        key = f"{r['arch']} (predicted)"
        series.setdefault(key, []).append((r["context"], r["decode_pred_s"] * 1e3))
        dashed.add(key)
    plots.lines(series, "context (tokens)", "decode time per token (ms)",
                f"Measured (solid) vs predicted (dashed) decode time on this machine "
                f"({device.bandwidth / 1e9:.0f} GB/s)", path, logy=True, dashed=dashed)


def _write_json(path: Path, data: dict) -> None:
    if not path.parent.is_dir():
        raise KvwallError(f"cannot write {path}: the folder {path.parent} does not exist")
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
