"""`kvwall report` below the command: claim the output folder, build the sections, write HTML and Markdown."""

from __future__ import annotations

import datetime
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvwall import __version__
from kvwall.errors import KvwallError
from kvwall.explore import DEFAULT_PORT
from kvwall.files import PROBE_PREFIX, check_folder, write_text
from kvwall.report.document import Document, Section, write_html, write_markdown
from kvwall.units import fmt_tokens

MARKER = ".kvwall-report"  # in every folder the report wrote: the only folders it writes into again
# what another report starting in the same folder right now may have made: the marker, its temporary, a probe
_OURS = (MARKER, f".{MARKER}.", PROBE_PREFIX)


@dataclass
class Written:
    html: Path
    markdown: Path
    figures: list[Path]
    measured: bool


def claim_folder(path: str, option: str = "--out") -> Path:
    """The report's folder, checked and marked before any work.

    The report writes only into a new or empty folder, or one it wrote before (it holds MARKER):
    never over files a user keeps there (``--out .`` next to the user's own report.md)."""
    out = check_folder(path, option)
    others = sorted(p.name for p in out.iterdir() if not p.name.startswith(_OURS))
    if others and not (out / MARKER).is_file():
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise KvwallError(f"{option} {out} holds files kvwall report did not write ({shown}); give a new or "
                          "empty folder (the report never overwrites files it did not write)")
    write_text(out / MARKER, "This folder was written by `kvwall report`, which may overwrite its own files here.\n")
    return out


def _sections() -> list[tuple[str, Callable[[Path], Section]]]:
    from kvwall.report import analysis, lineup, recall, serving

    return [("memory", analysis.memory_section), ("speed", analysis.speed_section), ("lineup", lineup.section),
            ("hardware", analysis.balance_section), ("serving", serving.section), ("recall", recall.section)]


def _measured_step(full: bool, say: Callable[[str], None] | None,
                   started: datetime.datetime) -> Callable[[Path], Section] | None:
    """The measured section's builder, or None when the engine (torch) is not installed. Tells ``say`` first
    what it will measure and about how long that takes. ``started``: when the report began (a calibration made
    since is this report's own)."""
    try:
        import torch  # noqa: F401

        from kvwall.report import measured
    except ImportError:
        return None
    plan, device, seconds = measured.plan(full, say)
    from kvwall.engine import native

    builds = native.build_note()  # the C++ kernels still missing (a calibration above builds them)
    if say:
        names = ", ".join(a.name for a in plan.archs)
        ctx = ", ".join(fmt_tokens(c) for c in plan.contexts)
        real = f" and {measured.REAL_MODEL} against transformers" if measured.real_model_installed() else ""
        say(f"measuring {names} at {ctx} tokens{real} on this machine: about {seconds:.0f} s"
            + ("" if full else " (--full: every architecture at 1k-32k)") + (f"; {builds}" if builds else ""))
    native.build_all()  # now, together, with progress: not one by one in the bench workers (their stderr is piped)
    return lambda out: measured.section(out, (plan, device), report_started=started)


def _costs_step(full: bool, say: Callable[[str], None] | None) -> Callable[[Path], Section] | None:
    """The "What each saving costs" section's builder (None without the engine); tells ``say`` what it will run."""
    try:
        import torch  # noqa: F401

        from kvwall.report import costs
    except ImportError:
        return None
    models, _, seconds = costs.plan(full)
    if say and models:
        say(f"measuring what each cache strategy costs in quality on {', '.join(models)}: about {seconds:.0f} s"
            + ("" if full else " (--full: every installed model, longer rows, and pass-key retrieval)"))
    return lambda out: costs.section(out, full)


EXPLORE = ("For another model, device, format or workload, `kvwall explore` opens the same predictor as an "
           "interactive page (bytes, fit, speed, the roofline and serving, updating as you type): run it and open "
           f"http://127.0.0.1:{DEFAULT_PORT}/ (its default address; `pip install 'kvwall[explore]'`).")


def _document(started: datetime.datetime) -> Document:
    now = started.strftime("%Y-%m-%d %H:%M %Z")
    return Document("kvwall: the memory wall of LLM decoding",
                    f"kvwall {__version__}, generated {now} on {platform.node()} ({platform.machine()}, "
                    f"{platform.python_implementation()} {platform.python_version()}); each section says where its "
                    "numbers come from: computed or measured in this run, or read from a cache or an earlier "
                    "calibration, with its date", intro=[EXPLORE])


def recall_provenance() -> str:
    """Where the recall section's numbers come from: `kvwall recall`'s cached results of its default grid, with
    the dates their files were written (the report never trains)."""
    from kvwall.measure import recall

    archs, widths, pairs, plan = recall.request(recall.DEFAULTS)
    files = [recall.cache_dir() / f"{recall._key(a, w, pairs, plan)}.json" for a, w in recall.models(archs, widths)]
    dates = sorted(datetime.datetime.fromtimestamp(f.stat().st_mtime).astimezone() for f in files if f.is_file())
    if len(dates) < len(files):
        return "nothing: no cached results of `kvwall recall`'s default grid on this machine"
    first, last = (d.strftime("%Y-%m-%d %H:%M %Z") for d in (dates[0], dates[-1]))
    span = first if first == last else f"{first} .. {last}"
    return f"cached results of an earlier `kvwall recall` run, written {span} (not trained in this run)"


# where a section's numbers come from, for the sections whose builder does not say (another module's)
_PROVENANCE = {"recall": recall_provenance}


def write_report(out: Path, measure: bool = True, full: bool = False, progress=None,
                 say: Callable[[str], None] | None = None) -> Written:
    """Every section (the measured one when asked for and the engine is installed), then report.html and .md.

    ``full``: the measured section runs every architecture at 1k-32k (else a few at 1k and 4k).
    ``progress``: a rich Progress to show the step being built, or None; ``say``: where to tell the user what
    a long step will do before it starts."""
    started = datetime.datetime.now().astimezone()
    doc = _document(started)
    steps = _sections()
    measured = _measured_step(full, say, started) if measure else None
    if measured:
        steps.append(("measuring this machine", measured))
    costs = _costs_step(full, say) if measure else None
    if costs:
        steps.append(("what each saving costs", costs))
    task = progress.add_task("report", total=len(steps)) if progress else None
    for name, build in steps:
        if progress:
            progress.update(task, description=name if build in (measured, costs) else f"analysis: {name}")
        section = build(out)
        if not section.provenance and name in _PROVENANCE:
            section.provenance = _PROVENANCE[name]()
        doc.sections.append(section)
        if progress:
            progress.advance(task)
    html = write_html(doc, out / "report.html")
    md = write_markdown(doc, out / "report.md")
    return Written(html, md, [f.path for f in doc.figures()], measured is not None)
