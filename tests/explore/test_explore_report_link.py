"""The report's HTML and Markdown point readers to `kvwall explore` at its default address."""

from __future__ import annotations

import datetime

from kvwall.commands.explore_cmd import HOST
from kvwall.explore import DEFAULT_PORT
from kvwall.report import build
from kvwall.report.document import write_html, write_markdown


def test_the_report_links_to_kvwall_explore(tmp_path):
    doc = build._document(datetime.datetime(2026, 12, 6, tzinfo=datetime.timezone.utc))
    html = write_html(doc, tmp_path / "r.html").read_text()
    assert DEFAULT_PORT == 8765 and HOST == "127.0.0.1"
    head = html.split("<h2>")[0]  # under the title, before the first section
    assert "<code>kvwall explore</code> opens the same predictor as an interactive page" in head
    assert "<a href='http://127.0.0.1:8765/'>http://127.0.0.1:8765/</a>" in head
    md = write_markdown(doc, tmp_path / "r.md").read_text()
    assert "`kvwall explore`" in md and "<http://127.0.0.1:8765/>" in md
