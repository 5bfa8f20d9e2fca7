"""The README's and docs' claims against the results files they cite: every file cited under benchmarks/results/
is in the repository, and every cited peer comparison (a results JSON whose rows name more than one engine)
records the threads each engine was given, row by row (issue 39: vLLM computed on one thread while kvwall had
two, and nothing in the file said so)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_.*/-]*")

# Cited peer comparisons measured before rows recorded their threads. Each leaves this list when its rerun lands
# (test_the_allow_list_holds_only_what_it_must says when): the lead prunes it.
NO_THREADS_YET: set[str] = set()  # empty since serve_peers_t2.json replaced serve_peers.json (2026-12-05)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def cited_paths(text: str) -> set[str]:
    """Every benchmarks/results/... path in `text`, without a sentence's closing period."""
    return {m.group(0).rstrip(".") for m in CITED.finditer(text)}


def resolve(cited: str, root: Path = ROOT) -> list[Path]:
    """The files a cited path names: itself, or what its glob (bench_1204_r*.json) matches; [] when none."""
    if "*" in cited:
        return sorted(root.glob(cited))
    path = root / cited
    return [path] if path.exists() else []


def row_lists(data) -> list[list[dict]]:
    """Every list of row objects anywhere in a results JSON (a list of rows, "runs", "rows", "medians",
    "real_models" / "results", ...)."""
    out = []
    if isinstance(data, list):
        if data and all(isinstance(r, dict) for r in data):
            out.append(data)
        for v in data:
            out += row_lists(v)
    elif isinstance(data, dict):
        for v in data.values():
            out += row_lists(v)
    return out


def rows_without_threads(data) -> list[dict]:
    """The rows of the peer comparisons in `data` (lists whose rows name more than one engine) that do not
    record the threads their engine was given."""
    missing = []
    for rows in row_lists(data):
        engines = {r.get("engine") for r in rows} - {None}
        if len(engines) > 1:
            missing += [r for r in rows if r.get("threads") is None]
    return missing


def cited_files() -> dict[str, list[Path]]:
    """Each cited path (README.md, docs/**/*.md) with the files it names."""
    return {c: resolve(c) for doc in documents() for c in sorted(cited_paths(doc.read_text(encoding="utf-8")))}


def test_the_checks_by_hand(tmp_path):
    """The scan and the rule on made-up text and files: a period ending a sentence is not part of a path, a glob
    names what it matches, and only a comparison of several engines must record threads."""
    text = "see `benchmarks/results/a.json`. Runs: benchmarks/results/r*.json and benchmarks/results/gone.json."
    assert cited_paths(text) == {"benchmarks/results/a.json", "benchmarks/results/r*.json",
                                 "benchmarks/results/gone.json"}
    (tmp_path / "benchmarks/results").mkdir(parents=True)
    for name in ("a.json", "r1.json", "r2.json"):
        (tmp_path / "benchmarks/results" / name).write_text("[]")
    assert [p.name for p in resolve("benchmarks/results/r*.json", tmp_path)] == ["r1.json", "r2.json"]
    assert resolve("benchmarks/results/gone.json", tmp_path) == []
    peers = [{"engine": "kvwall", "threads": 2}, {"engine": "vllm"}]
    assert rows_without_threads(peers) == [{"engine": "vllm"}]
    assert rows_without_threads({"runs": peers, "medians": [{"engine": "kvwall"}]}) == [{"engine": "vllm"}]
    assert rows_without_threads([{"engine": "kvwall"}, {"engine": "kvwall"}]) == []  # one engine: no comparison
    assert rows_without_threads({"real_models": {"results": [{"engine": "a", "threads": 1},
                                                             {"engine": "b", "threads": 1}]}}) == []


def test_every_cited_results_file_is_in_the_repository():
    missing = sorted(c for c, files in cited_files().items() if not files)
    assert not missing, f"cited but not in the repository: {', '.join(missing)}"


def test_cited_peer_comparisons_record_their_threads():
    bad = {}
    for files in cited_files().values():
        for path in files:
            rel = path.relative_to(ROOT).as_posix()
            if path.suffix != ".json" or rel in NO_THREADS_YET:
                continue
            missing = rows_without_threads(json.loads(path.read_text()))
            if missing:
                bad[rel] = len(missing)
    assert not bad, "peer comparisons whose rows do not record their threads (rows): " + \
        ", ".join(f"{k} ({v})" for k, v in sorted(bad.items()))


def test_the_allow_list_holds_only_what_it_must():
    """An allow-listed file leaves the list once it records its threads, or once no claim cites it."""
    cited = {p.relative_to(ROOT).as_posix() for files in cited_files().values() for p in files}
    for rel in sorted(NO_THREADS_YET):
        if rel not in cited:
            pytest.fail(f"{rel} is no longer cited: remove it from NO_THREADS_YET")
        if not rows_without_threads(json.loads((ROOT / rel).read_text())):
            pytest.fail(f"{rel} records its threads now: remove it from NO_THREADS_YET")
