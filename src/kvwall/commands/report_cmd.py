"""`kvwall report`: the catalog analysis (and, with the engine installed, measurements) as HTML + Markdown."""

from __future__ import annotations

import argparse
import time

from kvwall.commands import common
from kvwall.report.tables import console


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write report.html and report.md: the memory wall, predicted and measured")
    p.add_argument("--out", default="kvwall-report",
                   help="output folder (default ./kvwall-report/); new, empty, or one an earlier report wrote")
    p.add_argument("--no-measure", action="store_true", help="skip the measured section")
    p.add_argument("--full", action="store_true",
                   help="measure every architecture at 1k-32k (about 5-10 minutes) instead of a few at 1k and 4k")
    p.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # the default since --full; kept for scripts
    common.add_json(p)
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from rich.progress import Progress

    from kvwall.report.build import claim_folder, write_report

    out = claim_folder(args.out)
    started = time.time()
    with Progress(console=console(), transient=True, disable=args.json) as progress:
        say = None if args.json else progress.console.print
        w = write_report(out, measure=not args.no_measure, full=args.full, progress=progress, say=say)
    data = {"html": str(w.html), "markdown": str(w.markdown), "figures": [str(f) for f in w.figures],
            "measured": w.measured, "seconds": round(time.time() - started, 1)}
    return common.emit(args, data, lambda data: _print_report(data, args.no_measure))


def _print_report(data: dict, no_measure: bool) -> None:
    c = console()
    c.print(f"wrote {data['html']} and {data['markdown']} ({len(data['figures'])} figures) in {data['seconds']} s")
    if not data["measured"] and not no_measure:
        c.print("measured section skipped: it needs the engine (pip install 'kvwall[engine]')")
