"""`kvwall calibrate`: measure this machine's bandwidth and matmul throughput; save it for `--device local`."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

from kvwall.commands import common
from kvwall.predict.devices import profile_path
from kvwall.predict.step import PREFILL_ATTENTION
from kvwall.report.tables import console, table

CAPTION = ("read: bytes read once; copy: read + write; GEMV: matrix bytes / time. others: share of the CPUs "
           "other processes used meanwhile (busy steps are measured again, the quietest kept).")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine (bandwidth, GEMV, GEMM) and save it as --device local")
    p.add_argument("--quick", action="store_true", help="a few seconds, smaller buffers and fewer runs (rougher)")
    # the default named, not resolved: resolving $KVWALL_HOME here would fail every command when it is bad
    p.add_argument("--out", metavar="PATH", help="where to save the profile (default $KVWALL_HOME/local-device.json, "
                                                 "else ~/.cache/kvwall/local-device.json); an existing file is "
                                                 "replaced only if it is a kvwall device profile")
    common.add_json(p)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from kvwall.measure.calibrate import calibrate, check_target, save_profile

    path = check_target(args.out if args.out is not None else profile_path())
    with _progress() as report:
        cal = calibrate(quick=args.quick, progress=report)
    profile = cal.profile()
    save_profile(profile, path)
    return common.emit(args, profile | {"profile_path": str(path)}, lambda data: _print_calibration(cal, profile, path))


def _print_calibration(cal, profile: dict, path: Path) -> None:
    c = console()
    info = cal.info
    llc = f"{info['llc_bytes'] / 2**20:,.0f} MiB" if info.get("llc_bytes") else "unknown"
    c.print(f"[bold]this machine[/bold]: {info['cpu_model']}, {info['cpus']} CPUs, "
            f"{info['memory_bytes'] / 1e9:.1f} GB memory, last-level cache {llc}")
    rows = [[m.kind, m.method, m.dtype, m.size, _ms(m.median_s), _spread(m),
             f"{m.bandwidth / 1e9:,.1f}" if m.bandwidth else "-", f"{m.flops / 1e9:,.1f}" if m.flops else "-",
             f"{m.others_cpu:.0%}" + (f" ({m.attempts} tries)" if m.attempts > 1 else "")]
            for m in cal.measurements]
    c.print(table(f"measured (median of {cal.settings.runs} runs; GEMM {cal.settings.gemm_runs})",
                  ["kind", "method", "dtype", "size", "median", "runs min-max", "GB/s", "GFLOP/s", "others"],
                  rows, caption=CAPTION))
    flops = ", ".join(f"{d} {v / 1e9:,.0f}" for d, v in profile["peak_flops"].items())
    c.print(f"profile: bandwidth {profile['memory_bandwidth_Bps'] / 1e9:.1f} GB/s "
            f"({profile['measured']['read_method']}); GEMM GFLOP/s: {flops}")
    if profile.get("matmul_rows_Bps"):
        c.print(f"engine op model: {_op_model(profile)}")
    for note in profile["notes"][2:]:  # the first two are in the line above
        c.print(f"note: {note}")
    if profile["busy_warning"]:
        c.print(f"[yellow]warning[/yellow]: {profile['busy_warning']}")
    c.print(f"took {cal.elapsed_s:.1f} s; saved to {path}; use it with [bold]--device local[/bold]")


def _op_model(p: dict) -> str:
    """One line of the engine's own rates, as the roofline's `local` device uses them."""
    g = lambda v: f"{v / 1e9:,.1f}"  # noqa: E731
    rows = p["matmul_rows_Bps"]
    bw, fl = p.get("op_bandwidth_Bps", {}), p.get("op_flops", {})
    parts = ["matmul weights " + " / ".join(f"{g(rows[r])}" for r in rows) + f" GB/s at {' / '.join(rows)} rows"]
    for kernel, rates in (p.get("packed_rows_Bps") or {}).items():
        parts.append(f"packed {kernel.removeprefix('matmul:')} " + " / ".join(g(v) for v in rates.values())
                     + f" GB/s at {' / '.join(rates)} rows" + _packed_fixed(p, kernel))
    if "attention" in bw:
        parts.append(f"decode attention {g(bw['attention'])} GB/s + " + (f"{g(fl['attention'])} GFLOP/s"
                                                                          if "attention" in fl else "no FLOP rate"))
    prefill = p.get("prefill_attention_flops") or {}
    if prefill:  # by prompt tokens; an older profile has the one rate
        parts.append("prefill attention " + " / ".join(g(v) for v in prefill.values())
                     + f" GFLOP/s at {' / '.join(prefill)} tokens")
    elif PREFILL_ATTENTION in fl:
        parts.append(f"prefill attention {g(fl[PREFILL_ATTENTION])} GFLOP/s")
    if "latent" in fl:
        parts.append(f"MLA latent {g(fl['latent'])} GFLOP/s")
    parts += [f"{k.split(':')[1]} cache attention {g(v)} GB/s" for k, v in bw.items() if k.startswith("attention:")]
    mixers = {"attention": p.get("layer_overhead_s"), **p.get("mixer_overhead_s", {})}
    parts.append("dispatch " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in mixers.items() if v is not None)
                 + f" ms per block (+{(p.get('unfused_overhead_s') or 0) * 1e3:.2f} attention layer by layer), "
                 f"{p.get('step_overhead_s', 0) * 1e3:.2f} ms per step")
    pool, runner = p.get("paged_pool") or {}, p.get("runner_step") or {}
    if pool:  # what `simulate` adds for kvwall serve: its paged pool per attention layer, its runner per step
        parts.append(f"serving pool {pool['fixed_s'] * 1e3:.2f} ms + {pool['s_per_byte'] * 1e12:.0f} ms/GB gathered "
                     "per layer")
    if runner:
        parts.append(f"serving runner {runner['fixed_s'] * 1e3:.2f} ms + {runner['per_row_s'] * 1e3:.2f} ms a row "
                     f"per step + {runner.get('slowdown', 0.0):.0%} of its forwards")
    return "; ".join(parts)


def _packed_fixed(p: dict, kernel: str) -> str:
    """A packed kernel's fixed costs where calibrate measured them: per call, and per block on that path."""
    call, block = (p.get("op_fixed_s") or {}).get(kernel), (p.get("packed_overhead_s") or {}).get(kernel)
    return ((f" + {call * 1e6:.0f} us per call" if call is not None else "")
            + (f", {block * 1e3:.2f} ms per block" if block is not None else ""))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _spread(m) -> str:
    return f"{min(m.runs_s) * 1e3:,.1f}-{max(m.runs_s) * 1e3:,.1f} ms"


@contextmanager
def _progress():
    """A rich progress bar on a terminal's stderr; otherwise one line per finished step."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("calibrating: {task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("starting", total=None)

            def report(done, total, label, result):
                bar.update(task, completed=done, total=total, description=label)

            yield report
        return

    def report(done, total, label, result):
        if isinstance(result, float):  # an engine step: its seconds
            print(f"kvwall calibrate [{done}/{total}] {label}: {result:.1f} s", file=sys.stderr, flush=True)
        elif result is not None:
            rates = []
            if result.bandwidth:
                rates.append(f"{result.bandwidth / 1e9:.1f} GB/s")
            if result.flops:
                rates.append(f"{result.flops / 1e9:.1f} GFLOP/s")
            rate = ", ".join(rates)
            print(f"kvwall calibrate [{done}/{total}] {label}: {rate}", file=sys.stderr, flush=True)

    yield report
