"""The report's recall section: `kvwall recall`'s default grid from its results cache, never trained here (the
report stays fast: CI runs it); without those results, or with a damaged one (a warning names it), one line saying
how to make them."""

from __future__ import annotations

from pathlib import Path

from kvwall.report import plots
from kvwall.report.document import Figure, Section, Table
from kvwall.units import fmt_bytes

TITLE = "Recall against memory: what a fixed state forgets"


def section(out: Path, cache: Path | None = None) -> Section:
    from kvwall.measure import recall

    data = recall.cached(*recall.request(recall.DEFAULTS), cache=cache)
    if data is None:
        return Section(TITLE, paragraphs=[
            "No complete, undamaged cached results of the default recall grid on this machine (a damaged one is "
            "named in a warning, never shown): run `kvwall recall` (trains small attention, sliding-window, "
            "Mamba, Mamba-2, hybrid and Gated DeltaNet models on MQAR; see the README for its time) and "
            "the next report shows accuracy against kept bytes here."])
    fig = plots.recall(data, out / "recall.png")
    t = data["task"]
    return Section(
        TITLE,
        paragraphs=[f"Multi-query associative recall (MQAR, Zoology, Arora et al. 2023) at {t['seq']} tokens: "
                    "held-out accuracy of 2-block models built from the engine's own layers, against the bytes "
                    "each keeps per sequence (kvwall's predictor, fp32). Cached results of `kvwall recall`'s "
                    "default grid; `kvwall recall --retrain` trains them again."],
        tables=[_table(data)],
        figures=[Figure(fig, "MQAR recall accuracy against kept bytes per sequence (log x), a panel per number of "
                             "key-value pairs, points labelled by width", "recall")],
        assumptions=[f"chance is {t['chance'] * 100:.1f} % ({t['values']} values); accuracy on "
                     f"{data['plan']['test']} held-out sequences"])


def _table(data: dict) -> Table:
    """One row per architecture and width: kept bytes, then accuracy per number of pairs."""
    rows = data["results"]
    pairs = sorted({r["pairs"] for r in rows})
    keys = list(dict.fromkeys((r["arch"], r["width"]) for r in rows))
    acc = {(r["arch"], r["width"], r["pairs"]): r for r in rows}
    body = [[a, str(w), fmt_bytes(acc[a, w, pairs[0]]["kept_bytes"]),
             *(f"{acc[a, w, n]['accuracy'] * 100:.1f} %" for n in pairs)] for a, w in keys]
    return Table(["arch", "width", "kept bytes", *(f"{n} pairs" for n in pairs)], body,
                 "accuracy per number of key-value pairs")
