"""`kvwall bench`: every strategy on this machine, measured next to its prediction."""

from __future__ import annotations

import argparse
import json
import time

from kvwall.commands import common
from kvwall.engine.caches.registry import CACHE_NAMES
from kvwall.errors import KvwallError
from kvwall.files import PLOT_EXTS, check_output, write_text
from kvwall.report.measured import plot_results
from kvwall.report.tables import console, table
from kvwall.spec.gguf_meta import PACKAGED
from kvwall.units import fmt_bytes, fmt_tokens, parse_int_list, parse_token_list, parse_tokens, whole

DEFAULT_CONTEXTS = "1k,4k,16k,32k"
QUICK_CONTEXTS = "1k,4k"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark architectures on this machine against the roofline prediction")
    p.add_argument("archs", nargs="*", help="architectures (default: all; see --list), model directories, or real "
                   "models (smollm2-135m, gemma-3-270m, a .gguf): those run at --batch against transformers")
    p.add_argument("--list", action="store_true", help="list the architectures and exit")
    p.add_argument("--context", help=f"contexts (default {DEFAULT_CONTEXTS}; --quick: {QUICK_CONTEXTS})")
    p.add_argument("--steps", type=whole(1), default=8, help="timed decode steps per point (median; default 8)")
    p.add_argument("--prefill-max", default="4k", help="time a real prefill up to this context (default 4k)")
    p.add_argument("--quick", action="store_true", help="fewer architectures and contexts (about a minute)")
    p.add_argument("--threads", type=whole(1, 1 << 16), help="torch threads (default: all cores)")
    p.add_argument("--batch", default="1,16", help="real models: batch sizes (default 1,16)")
    p.add_argument("--cache", help=f"real models: caches (default all: {','.join(CACHE_NAMES)})")
    common.add_weights(p, many=True)  # real models: one kvwall engine per weight format (default fp32)
    p.add_argument("--plot", metavar="PNG", help="measured vs predicted decode time vs context")
    p.add_argument("--save", metavar="JSON", help="also write the results to this file")
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from kvwall.measure.archs import ARCHS

    if args.list:
        return common.emit(args, [{"name": a.name, "cache": a.cache, "about": a.about} for a in ARCHS.values()],
                           _print_archs)
    common.need_torch("kvwall bench runs the engine")
    if args.steps < 1:
        raise KvwallError("--steps must be at least 1")
    save = check_output(args.save, option="--save") if args.save is not None else None
    plot = check_output(args.plot, PLOT_EXTS, option="--plot") if args.plot is not None else None
    from kvwall.measure import bench

    real = real_plan(args)  # its options checked before any model is looked up
    archs = bench.resolve_archs(args.archs, args.quick)
    real.archs = [a for a in archs if a.real]
    if args.weights and len(real.archs) < len(archs):  # the context sweep runs fp32: say so, do not ignore it
        raise KvwallError(f"--weights applies to real models (a .gguf, {' / '.join(PACKAGED)}); "
                          f"{', '.join(a.name for a in archs if not a.real)} run the fp32 context sweep: "
                          "drop --weights or bench them apart")
    contexts = sorted(set(parse_token_list(args.context or (QUICK_CONTEXTS if args.quick else DEFAULT_CONTEXTS))))
    plan = bench.Plan([a for a in archs if not a.real], contexts, steps=args.steps,
                      prefill_max=parse_tokens(args.prefill_max, "prefill max"), threads=args.threads)
    device = bench.local_profile(None if args.json else console().print)
    from kvwall.engine.native import build_all

    build_all()  # the missing C++ kernels, together and with progress, before the workers (stderr piped) need them
    started = time.time()
    results = _run_with_progress(plan, device, quiet=args.json)
    real_rows = _run_real(real, device) if real.archs else []
    data = bench.bench_data(plan, device, results, time.time() - started)
    if real.archs:
        data["real_models"] = real_data(real, real_rows)
    if save:
        write_text(save, json.dumps(data, indent=2))
    if plot:
        plot_results(results, device, plot)
        data["plot"] = args.plot
    return common.emit(args, data, print_results)


def real_plan(args):
    from kvwall.engine.caches.registry import parse_cache
    from kvwall.measure.real_bench import RealPlan

    caches = [parse_cache(c).text for c in args.cache.split(",")] if args.cache else list(CACHE_NAMES)
    batches = tuple(parse_int_list(args.batch, "--batch"))  # whole numbers >= 1, or a one-line error
    return RealPlan([], caches, batches, steps=args.steps, threads=args.threads, weights=args.weights or ["fp32"])


def real_data(plan, rows: list[dict]) -> dict:
    from kvwall.measure.real_bench import summary

    return {"prompt": plan.prompt, "steps": plan.steps, "warmup": plan.warmup, "batches": list(plan.batches),
            "caches": plan.caches, "weights": plan.weights, "results": rows, "skipped": plan.skipped,
            "summary": summary(rows)}


def _run_real(plan, device) -> list[dict]:
    """The real models' runs, with their progress on stderr (stdout keeps the table or the JSON)."""
    from rich.console import Console
    from rich.progress import Progress

    from kvwall.measure import real_bench

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("real models: loading", total=len(plan.archs) * len(plan.batches))
        seen = set()

        def on_row(r):
            if (r["arch"], r["batch"]) not in seen:
                seen.add((r["arch"], r["batch"]))
                progress.update(task, advance=1, description=f"{r['arch']} batch {r['batch']}")

        return real_bench.run(plan, device, on_row)


def _print_archs(rows: list[dict]) -> None:
    console().print(table("bench architectures (121.1-144.5M parameters, random weights)", ["name", "cache", "what"],
                          [[r["name"], r["cache"], r["about"]] for r in rows]))


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
        rows.append([r["arch"], fmt_tokens(r["context"]), f"{r['decode_s'] * 1e3:.1f}",
                     f"{r['decode_pred_s'] * 1e3:.1f}", f"{r['decode_error'] * 100:+.0f}%", r["decode_bound"], pf,
                     fmt_bytes(r["cache_bytes"]), fmt_bytes(r["cache_pred_bytes"]), fmt_bytes(r["peak_rss_bytes"])])
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
    if s.get("busy_archs"):
        c.print(f"[yellow]warning:[/] other processes used up to {s['others_cpu_share_max']:.0%} of the CPUs while "
                f"{', '.join(s['busy_archs'])} ran: those timings are slower than this machine is; run "
                "`kvwall bench` again on a quiet machine")
    if data.get("real_models"):
        print_real(data["real_models"])
    for sk in data["skipped"] + (data.get("real_models") or {}).get("skipped", []):
        where = f" @ {fmt_tokens(sk['context'])}" if sk.get("context") else ""
        c.print(f"skipped {sk['arch']}{where}: {sk['reason']}")
    if data.get("plot"):
        c.print(f"plot written to {data['plot']}")



def print_real(real: dict) -> None:
    """Real models: tok/s per engine and batch, transformers alongside, the roofline's prediction."""
    rows = []
    for r in real["results"]:
        vs = f"{r['vs_transformers']:.2f}x" if r.get("vs_transformers") else "-"
        pred = f"{r['pred_tok_s']:.1f}" if r.get("pred_tok_s") else "-"
        err = f"{r['pred_error'] * 100:+.0f}%" if r.get("pred_error") is not None else "-"
        same = {True: "yes", False: "no", None: "-"}[r.get("same_tokens_as_transformers")]
        cache = fmt_bytes(r["cache_bytes"]) if r.get("cache_bytes") is not None else "-"
        engine = r["engine"] if r["engine"] == "transformers" else f"{r['engine']} ({r['weights']})"
        rows.append([r["arch"], str(r["batch"]), engine, f"{r['tok_s']:.1f}", f"{r['step_s'] * 1e3:.1f}", vs,
                     pred, err, same, cache])
    console().print(table(f"real models: decode tok/s, {real['prompt']}-token prompt, greedy; median of "
                          f"{real['steps']} steps taken in turn by every engine in one process",
                          ["model", "batch", "engine", "tok/s", "ms/step", "vs transformers", "pred tok/s",
                           "pred error", "same tokens", "cache"], rows,
                          caption="engine (weights): fp32 activations, weights as --weights holds them (transformers: "
                          "fp32); pred = roofline on the local profile for those weights and the cache's KV format; "
                          "pred error = predicted step / measured - 1; same tokens = greedy tokens equal "
                          "transformers'"))
