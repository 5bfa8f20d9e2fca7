"""`kvwall validate`: the ideal roofline against the published measurements in catalog/measurements.json."""

from __future__ import annotations

import argparse

from kvwall import catalog
from kvwall.commands import common
from kvwall.files import PLOT_EXTS, check_output
from kvwall.predict.validate import TIME_METRICS, validate
from kvwall.report import plots
from kvwall.report.tables import console, table

# How a metric's figure reads in the table (its unit).
_UNITS = {"decode_tok_s_per_seq": "tok/s/seq", "throughput_tok_s": "tok/s", "tpot_s": "s", "ttft_s": "s"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="predicted against published measurements: error per row, engine, device")
    p.add_argument("--engine", metavar="NAME", help="only this engine's rows (gpt-fast, TensorRT-LLM, ...)")
    p.add_argument("--device", metavar="NAME", help="only this device's rows (a100-80gb, h100-sxm, ...)")
    p.add_argument("--plot", metavar="PNG", help="predicted vs measured, log-log, one marker per engine")
    common.add_json(p)
    p.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    plot = check_output(args.plot, PLOT_EXTS, option="--plot") if args.plot is not None else None
    data = validate(catalog.measurements(), args.engine, args.device)
    if plot:
        _plot(data["rows"], plot)
        data["plot"] = args.plot
    return common.emit(args, data, _print)


def _plot(rows: list[dict], path) -> None:
    """Rates on both axes (1 / time for TPOT and TTFT), so that above the line = prediction faster."""
    rate = lambda r, v: 1 / v if r["metric"] in TIME_METRICS else v  # noqa: E731
    points = [{"group": r["engine"], "measured": rate(r, r["measured"]), "predicted": rate(r, r["predicted"])}
              for r in rows if "error" in r]
    plots.versus(points, "measured (tok/s; 1/s for TPOT and TTFT rows)", "predicted, ideal roofline (same unit)",
                 "kvwall's ideal roofline against published measurements (above the line: prediction faster)", path)


def _fig(metric: str, v: float) -> str:
    if metric in TIME_METRICS:
        return f"{v * 1e3:,.2f} ms"
    return f"{v:,.1f} {_UNITS[metric]}" if v < 1000 else f"{v:,.0f} {_UNITS[metric]}"


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{e * 100:+.0f} %"


def _print(data: dict) -> None:
    c = console()
    rows = [[r["id"], r["model"], f"{r['device']} x{r['n_devices']}", r["engine"], r["metric"],
             _fig(r["metric"], r["measured"]), _fig(r["metric"], r["predicted"]), _pct(r["error"])]
            for r in data["rows"] if "error" in r]
    conv = data["conventions"]
    c.print(table("ideal roofline against published measurements",
                  ["id", "model", "device", "engine", "metric", "measured", "predicted", "error"], rows,
                  caption=f"error: {conv['error']}; decode at {conv['decode_context']}; throughput = "
                          f"{conv['throughput']}; math in {conv['compute_dtype']}"))
    s = data["summary"]
    c.print(table(f"summary: {s['checked']} rows checked, {s['skipped']} skipped",
                  ["group", "rows", "median |error|", "median error", "max |error|", "worst row"],
                  [_summary_row(name, st) for name, st in _groups(s)]))
    for r in data["rows"]:
        if "skipped" in r:
            c.print(f"skipped {r['id']}: {r['skipped']}")
    if data.get("plot"):
        c.print(f"plot written to {data['plot']}")


def _groups(s: dict) -> list[tuple[str, dict]]:
    return ([("all", s["all"])] + [(f"engine {k}", v) for k, v in s["engines"].items()]
            + [(f"device {k}", v) for k, v in s["devices"].items()])


def _summary_row(name: str, st: dict) -> list:
    return [name, st["n"], _pct(st["median_abs_error"]).lstrip("+"), _pct(st["median_error"]),
            _pct(st["max_abs_error"]).lstrip("+"), st["worst"] or "-"]
