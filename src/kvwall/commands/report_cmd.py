"""`kvwall report`: the catalog analysis (and, with the engine installed, measurements) as HTML + Markdown."""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

from kvwall import __version__
from kvwall.commands import common
from kvwall.errors import KvwallError
from kvwall.report.tables import console, print_json
from kvwall.units import fmt_tokens


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write report.html and report.md: the memory wall, predicted and measured")
    p.add_argument("--out", default="kvwall-report", help="output folder (default ./kvwall-report/)")
    p.add_argument("--no-measure", action="store_true", help="skip the measured section")
    p.add_argument("--full", action="store_true",
                   help="measure every architecture at 1k-32k (about 5-10 minutes) instead of a few at 1k and 4k")
    p.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # the default since --full; kept for scripts
    common.add_json(p)
    p.set_defaults(func=cmd_report)


def _sections():
    from kvwall.report import analysis

    return [("memory", analysis.memory_section), ("speed", analysis.speed_section),
            ("hardware", analysis.balance_section)]


def cmd_report(args) -> int:
    from rich.progress import Progress

    from kvwall.report.document import Document, write_html, write_markdown

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise KvwallError(f"--out {out} is a file; give a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvwallError(f"cannot create {out}: {exc.strerror}") from None
    started = time.time()
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    doc = Document("kvwall: the memory wall of LLM decoding",
                   f"kvwall {__version__}, generated {now} on {platform.node()} ({platform.machine()}, "
                   f"{platform.python_implementation()} {platform.python_version()}); every number below comes "
                   "from kvwall's predictor or from measurement in this run")
    steps = _sections()
    measured = None if args.no_measure else _measured_step(args.full, quiet=args.json)
    with Progress(console=console(), transient=True, disable=args.json) as progress:
        task = progress.add_task("report", total=len(steps) + (1 if measured else 0))
        for name, build in steps:
            progress.update(task, description=f"analysis: {name}")
            doc.sections.append(build(out))
            progress.advance(task)
        if measured:
            progress.update(task, description="measuring this machine")
            doc.sections.append(measured(out, progress))
            progress.advance(task)
    html = write_html(doc, out / "report.html")
    md = write_markdown(doc, out / "report.md")
    data = {"html": str(html), "markdown": str(md), "figures": [str(f.path) for f in doc.figures()],
            "measured": measured is not None, "seconds": round(time.time() - started, 1)}
    if args.json:
        print_json(data)
        return 0
    c = console()
    c.print(f"wrote {html} and {md} ({len(data['figures'])} figures) in {data['seconds']} s")
    if measured is None and not args.no_measure:
        c.print("measured section skipped: it needs the engine (pip install 'kvwall[engine]')")
    return 0


def _measured_step(full: bool, quiet: bool):
    """The measured section's builder, or None when the engine (torch) is not installed. Says first what
    it will measure and about how long that takes."""
    try:
        import torch  # noqa: F401

        from kvwall.report import measured
    except ImportError:
        return None
    say = None if quiet else (lambda text: console().print(text))
    plan, device, seconds = measured.plan(full, say)
    if say:
        names = ", ".join(a.name for a in plan.archs)
        ctx = ", ".join(fmt_tokens(c) for c in plan.contexts)
        say(f"measuring {names} at {ctx} tokens on this machine: about {seconds:.0f} s"
            + ("" if full else " (--full: every architecture at 1k-32k)"))
    return lambda out, progress: measured.section(out, (plan, device), progress=progress)
