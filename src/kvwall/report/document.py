"""A report as data (sections of text, tables and figures) written out as self-contained HTML and Markdown."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvwall.files import write_text


@dataclass
class Table:
    columns: list[str]
    rows: list[list]
    caption: str = ""


@dataclass
class Figure:
    path: Path  # PNG written next to the report
    caption: str
    key: str  # stable id, e.g. "cache-per-token"


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    provenance: str = ""  # where its numbers come from: this run, a cache or an earlier calibration, with dates


@dataclass
class Document:
    title: str
    subtitle: str
    sections: list[Section] = field(default_factory=list)
    intro: list[str] = field(default_factory=list)  # paragraphs under the title; `code` and http:// links marked up

    def figures(self) -> list[Figure]:
        return [f for s in self.sections for f in s.figures]


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#1d2330;line-height:1.45}
h1{margin-bottom:.2em} .sub{color:#5a6372;margin-top:0}
h2{border-bottom:2px solid #e3e7ee;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:1em 0;font-size:.88em}
th,td{border:1px solid #d6dbe3;padding:.3em .6em;text-align:right} th{background:#f1f4f8}
td:first-child,th:first-child{text-align:left}
figure{margin:1.5em 0} figure img{max-width:100%;border:1px solid #e3e7ee}
figcaption,.caption{color:#5a6372;font-size:.9em}
.assume{background:#f7f9fc;border-left:4px solid #8aa4c8;padding:.5em 1em;font-size:.9em}
.prov{color:#5a6372;font-size:.9em;font-style:italic;margin-top:-.5em}
"""


def _marked(text: str) -> str:
    """Escaped text with `code` as <code> and each http:// address as a link (the intro's only markup)."""
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text, quote=False))
    return re.sub(r"(http://[^\s<]+[^\s<.,;)])", r"<a href='\1'>\1</a>", out)


def write_html(doc: Document, path: Path) -> Path:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(doc.title)}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(doc.title)}</h1><p class='sub'>{html.escape(doc.subtitle)}</p>"]
    parts += [f"<p class='intro'>{_marked(p)}</p>" for p in doc.intro]
    for s in doc.sections:
        parts.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.provenance:
            parts.append(f"<p class='prov'>Source: {html.escape(s.provenance)}</p>")
        parts += [f"<p>{html.escape(p)}</p>" for p in s.paragraphs]
        for t in s.tables:
            head = "".join(f"<th>{html.escape(str(c))}</th>" for c in t.columns)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
                           for row in t.rows)
            cap = f"<p class='caption'>{html.escape(t.caption)}</p>" if t.caption else ""
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{cap}")
        for f in s.figures:
            data = base64.b64encode(f.path.read_bytes()).decode("ascii")
            parts.append(f"<figure id='{f.key}'><img alt='{html.escape(f.caption)}' "
                         f"src='data:image/png;base64,{data}'><figcaption>{html.escape(f.caption)}</figcaption>"
                         "</figure>")
        if s.assumptions:
            items = "".join(f"<li>{html.escape(a)}</li>" for a in s.assumptions)
            parts.append(f"<div class='assume'><b>Assumptions</b><ul>{items}</ul></div>")
    parts.append("</body></html>")
    return write_text(path, "\n".join(parts))


def write_markdown(doc: Document, path: Path) -> Path:
    out = [f"# {doc.title}", "", f"_{doc.subtitle}_", ""]
    for p in doc.intro:
        out += [re.sub(r"(http://\S+[^\s.,;)])", r"<\1>", p), ""]
    for s in doc.sections:
        out += [f"## {s.title}", ""]
        if s.provenance:
            out += [f"_Source: {s.provenance}_", ""]
        for p in s.paragraphs:
            out += [p, ""]
        for t in s.tables:
            out.append("| " + " | ".join(str(c) for c in t.columns) + " |")
            out.append("|" + "|".join("---" for _ in t.columns) + "|")
            out += ["| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" for row in t.rows]
            out += ["", f"_{t.caption}_" if t.caption else "", ""]
        for f in s.figures:
            out += [f"![{f.caption}]({f.path.name})", "", f"_{f.caption}_", ""]
        if s.assumptions:
            out += ["**Assumptions**", ""] + [f"- {a}" for a in s.assumptions] + [""]
    return write_text(path, "\n".join(out))

