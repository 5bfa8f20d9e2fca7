"""`kvwall validate`: predictions (ideal, and expected scored leave-one-out) against the published measurements
in catalog/measurements.json; `--fit` refits expected mode's figures into the user's table ($KVWALL_HOME/
efficiency.json, which expected mode then reads) or `--out FILE`: never into the installed package unless named."""

from __future__ import annotations

import argparse

from kvwall import api
from kvwall.commands import common
from kvwall.predict.expected import MODES
from kvwall.predict.validate import OUTLIER, SCORES, TIME_METRICS
from kvwall.report.tables import console, table

# How a metric's figure reads in the table (its unit).
_UNITS = {"decode_tok_s_per_seq": "tok/s/seq", "throughput_tok_s": "tok/s", "tpot_s": "s", "ttft_s": "s"}
_MODE_WORDS = {"ideal": "ideal roofline (datasheet peaks, no fixed costs)",
               "expected": "expected (fitted fractions of peak), each row by a fit without it (leave-one-out)",
               "expected_loso": "expected, each row by a fit without any row of its source document "
                                "(leave-one-source-out)"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="predicted against published measurements: error per row, engine, device")
    p.add_argument("--engine", metavar="NAME", help="only this engine's rows (gpt-fast, TensorRT-LLM, ...)")
    p.add_argument("--device", metavar="NAME", help="only this device's rows (a100-80gb, h100-sxm, ...)")
    p.add_argument("--mode", choices=MODES, default="expected",
                   help="the mode whose errors the summary and `predicted`/`error` show (default expected; "
                        "the table shows both)")
    p.add_argument("--plot", metavar="PNG", help="predicted vs measured, log-log, one marker per engine, both modes")
    p.add_argument("--fit", action="store_true",
                   help="refit expected mode on the whole table first and save it where expected mode reads it "
                        "($KVWALL_HOME/efficiency.json, else ~/.cache/kvwall/efficiency.json), or to --out")
    p.add_argument("--out", metavar="JSON", help="with --fit: write the fitted table here instead (maintainers: "
                                                 "src/kvwall/catalog/efficiency.json updates the packaged one)")
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_validate)


def cmd_validate(args) -> int:
    r = api.validate(engine=args.engine, device=args.device, mode=args.mode, fit=args.fit, out=args.out,
                     plot=args.plot)
    return common.emit(args, r.to_dict(), _print)


def _fig(metric: str, v: float) -> str:
    if metric in TIME_METRICS:
        return f"{v * 1e3:,.2f} ms"
    return f"{v:,.1f} {_UNITS[metric]}" if v < 1000 else f"{v:,.0f} {_UNITS[metric]}"


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{e * 100:+.0f} %"


def _print(data: dict) -> None:
    c = console()
    rows = [[r["id"] + ("" if r["expected"]["in_fit"] else " (not fitted)"), r["model"],
             f"{r['device']} x{r['n_devices']}", r["engine"], _fig(r["metric"], r["measured"]),
             _fig(r["metric"], r["ideal"]["predicted"]), _pct(r["ideal"]["error"]),
             _fig(r["metric"], r["expected"]["predicted"]), _pct(r["expected"]["error"]),
             _pct(r["expected"]["loso_error"])]
            for r in data["rows"] if "error" in r]
    conv = data["conventions"]
    c.print(table("predicted against published measurements: ideal roofline and expected (leave-one-out)",
                  ["id", "model", "device", "engine", "measured", "ideal", "error", "expected (LOO)", "error",
                   "error, source held out"], rows,
                  caption=f"error: {conv['error']}; decode at {conv['decode_context']}; throughput = "
                          f"{conv['throughput']}; math in {conv['compute_dtype']}"))
    for score in SCORES:
        s = data["summaries"][score]
        c.print(table(f"summary, {_MODE_WORDS[score]}: {s['checked']} rows checked, {s['skipped']} skipped",
                      ["group", "rows", "median |error|", "median error", "max |error|", "worst row"],
                      [_summary_row(name, st) for name, st in _groups(s)]))
    c.print(_medians(data["summaries"]))
    _print_fit(c, data["fit"])
    for r in data["rows"]:
        if "skipped" in r:
            c.print(f"skipped {r['id']}: {r['skipped']}")
        elif r.get("exclude_from_fit"):
            c.print(f"not fitted {r['id']}: {r['exclude_from_fit']}")
        if "outlier" in r:
            c.print(f"outlier {r['id']} ({_pct(r['expected']['error'])} leave-one-out, over {OUTLIER:.0%}): "
                    f"{r['outlier']}")
    if data.get("plot"):
        c.print(f"plot written to {data['plot']}")
    if data.get("fit_written"):
        c.print(f"fitted table written to {data['fit_written']}")


def _print_fit(c, f: dict) -> None:
    c.print(f"expected mode: the figures in {f['source']}, fitted {f['date']} to table version {f['table_version']}; "
            "no engine factor (one set of figures for every engine: an engine factor, or a cache factor per engine "
            "class, scored worse held out)")
    if f["stale"]:
        c.print(f"warning: the table changed since (now {f['current_table_version']}); run `kvwall validate --fit`")


def _groups(s: dict) -> list[tuple[str, dict]]:
    return ([("all", s["all"])] + [(f"engine {k}", v) for k, v in s["engines"].items()]
            + [(f"device {k}", v) for k, v in s["devices"].items()]
            + [(f"context {k}", v) for k, v in s["bands"].items()]
            + [(f"source {k}", v) for k, v in s["sources"].items()])


def _medians(summaries: dict) -> str:
    """Expected mode's two scores side by side: overall and in the longest context band."""
    def one(s: dict) -> str:
        long = s["bands"].get(">= 16k")
        tail = f" (>= 16k: {_pct(long['median_abs_error']).lstrip('+')})" if long else ""
        return _pct(s["all"]["median_abs_error"]).lstrip("+") + tail

    return (f"expected mode, median |error|: leave-one-row-out {one(summaries['expected'])}, "
            f"leave-one-source-out {one(summaries['expected_loso'])}")


def _summary_row(name: str, st: dict) -> list:
    return [name, st["n"], _pct(st["median_abs_error"]).lstrip("+"), _pct(st["median_error"]),
            _pct(st["max_abs_error"]).lstrip("+"), st["worst"] or "-"]
