"""`kvwall recall`: MQAR recall of small attention, sliding-window, Mamba, Mamba-2, hybrid and Gated DeltaNet models
against the bytes each keeps per sequence (kvwall.measure.recall)."""

from __future__ import annotations

import argparse

from kvwall.commands import common
from kvwall.files import PLOT_EXTS, check_output
from kvwall.measure import machine
from kvwall.measure.recall import DEFAULTS, QUICK, request
from kvwall.report.tables import console, table
from kvwall.units import fmt_bytes, fmt_count, whole


def register(sub: argparse._SubParsersAction) -> None:
    d = DEFAULTS
    p = sub.add_parser(
        "recall", help="train small models on multi-query associative recall: accuracy against kept bytes",
        description="Multi-query associative recall (MQAR, Zoology): each sequence opens with N key-value pairs and "
                    "later asks for each key's value. Trains 2-block models built from the engine's own layers "
                    "(attention, sliding:W, mamba, mamba2, hybrid = a Mamba block then an attention block, "
                    "gated_deltanet = Gated DeltaNet with Mamba-2's state bytes) at each "
                    "width and number of pairs, and sets their held-out accuracy beside the bytes each keeps per "
                    "sequence (kvwall's predictor: K/V for attention, window-bounded for sliding, fixed state for "
                    "Mamba). As in Zoology, one model per architecture and width trains on the mixture of the pair "
                    "counts and is evaluated at each. Results are cached per model under ~/.cache/kvwall/recall, so "
                    "a re-run only trains what changed.")
    p.add_argument("--archs", metavar="LIST",
                   help=f"attention, sliding:W, mamba, mamba2, hybrid, gated_deltanet (default {d['archs']})")
    p.add_argument("--widths", metavar="LIST",
                   help=f"hidden sizes, multiples of 32 (default {d['widths']})")
    p.add_argument("--pairs", metavar="LIST",
                   help=f"key-value pairs per sequence, at most seq/4 (default {d['pairs']})")
    p.add_argument("--seq", type=whole(8, 4096), default=None, metavar="L",
                   help=f"tokens per sequence, the evaluation length of kept bytes (default {d['seq']})")
    p.add_argument("--steps", type=whole(1, 1_000_000), default=None, metavar="N",
                   help=f"most training steps per model (batch 32; default {d['steps']}; fewer when accuracy "
                        "reaches 99.5 %% or stops improving)")
    p.add_argument("--seed", type=whole(0, 2**31 - 1), default=0, help="seed of weights and data (default 0)")
    p.add_argument("--quick", action="store_true",
                   help=f"a few minutes: width {QUICK['widths']}, pairs {QUICK['pairs']}, {QUICK['seq']} tokens, "
                        f"{QUICK['steps']} steps "
                        "(options given explicitly still win)")
    p.add_argument("--jobs", type=whole(1, 256), default=None, metavar="N",
                   help="models trained at once, each on its own process and one thread (default: the CPUs this "
                        "process may use); results equal a run with --jobs 1")
    p.add_argument("--retrain", action="store_true", help="train again even where a cached result exists")
    p.add_argument("--plot", metavar="FILE", help="accuracy against kept bytes, a panel per number of pairs "
                   "(.png, .pdf or .svg)")
    common.add_json(p)
    p.set_defaults(func=cmd_recall)


def _choices(args) -> dict:
    """What was asked: explicit options first, then --quick's, then the defaults (every option defaults to None,
    so an explicit value equal to a default still wins over --quick, and an empty one is refused, not defaulted)."""
    base = QUICK if args.quick else DEFAULTS
    return {name: base[name] if getattr(args, name) is None else getattr(args, name) for name in DEFAULTS}


def cmd_recall(args) -> int:
    from kvwall.measure import recall

    c = _choices(args)
    plot = check_output(args.plot, PLOT_EXTS, option="--plot") if args.plot is not None else None
    archs, widths, pairs, plan = request(c, args.seed)
    common.need_torch("kvwall recall trains models with the engine")
    jobs = args.jobs or machine.cpu_count()
    data = _run_with_progress(recall, archs, widths, pairs, plan, args.retrain, jobs, quiet=args.json)
    if plot:
        from kvwall.report.plots import recall as recall_plot

        recall_plot(data, plot)
        data["plot"] = str(plot)
    return common.emit(args, data, print_recall)


def _run_with_progress(recall, archs, widths, pairs, plan, retrain: bool, jobs: int, quiet: bool) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(recall.models(archs, widths))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=quiet) as progress:
        task = progress.add_task("recall", total=total)
        training: dict[str, str] = {}  # label -> its latest status, one per model training now (--jobs)

        def show(label: str, text: str | None) -> None:
            if text is None:
                training.pop(label, None)
            else:
                training[label] = text
            progress.update(task, description="; ".join(f"{k}: {v}" for k, v in training.items()) or "recall")

        def done(label: str, _rows) -> None:
            show(label, None)
            progress.update(task, advance=1)

        return recall.run(archs, widths, pairs, plan, retrain=retrain, jobs=jobs,
                          on_start=lambda label, i: show(label, "training"),
                          on_eval=lambda label, step, acc: show(label, f"step {step}, {acc * 100:.1f}%"),
                          on_done=done)


def print_recall(data: dict) -> None:
    c = console()
    t = data["task"]
    rows = [[r["arch"], str(r["width"]), str(r["pairs"]), f"{r['accuracy'] * 100:.1f}%", fmt_count(r["params"]),
             fmt_bytes(r["kept_bytes"]), fmt_bytes(r["kv_bytes"]), fmt_bytes(r["state_bytes"]),
             f"{r['steps']} ({r['stopped']})", "cached" if r["cached"] else f"{r['train_seconds']} s"]
            for r in data["results"]]
    c.print(table(f"recall against memory: MQAR at {t['seq']} tokens ({t['keys']} keys, {t['values']} values, "
                  f"chance {t['chance'] * 100:.1f}%)",
                  ["arch", "width", "pairs", "accuracy", "params", "kept bytes", "K/V", "state", "steps", "took"],
                  rows, caption=f"held-out accuracy on {data['plan']['test']} sequences; kept bytes: kvwall's "
                                f"predictor, one sequence of {t['seq']} tokens in fp32"))
    on = f" on {data['jobs']} processes" if data.get("jobs", 1) > 1 else ""
    c.print(f"{data['trained']} models trained{on}, {data['cached']} from the cache ({data['cache']}); took "
            f"{data['seconds']} s")
    if data.get("plot"):
        c.print(f"plot written to {data['plot']}")
