"""Output files on the command line: a bad --plot/--save/--out is one line before any work, and
`kvwall report` never overwrites a file it did not write."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvwall.cli import main

HAS_PROC = Path("/proc/self").is_dir()


def one_line_error(capsys, argv: list[str], names: str, message: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwall: error: ") and err.count("\n") == 1, err
    assert names in err and message in err, err
    return err


def _bad_plots(tmp: Path) -> list[tuple[str, str, str]]:
    """(--plot value, what the message names, what it says) for each kind of bad path."""
    (tmp / "afile").write_text("")
    cases = [(str(tmp), str(tmp), "is a directory"),
             (str(tmp / "x.txt"), "x.txt", "extension '.txt'"),
             (str(tmp / "x"), str(tmp / "x"), "no extension"),
             (str(tmp / "afile" / "x.png"), str(tmp / "afile"), "is a file, not a folder"),
             (str(tmp / "nodir" / "x.png"), str(tmp / "nodir"), "does not exist"),
             ("~kvwall-nosuchuser/x.png", "~kvwall-nosuchuser", "no user"),
             ("", "--plot", "is empty")]
    if HAS_PROC:
        cases.append(("/proc/x.png", "/proc/x.png", "does not take new files"))
    return cases


@pytest.mark.parametrize("command", [["roofline", "gpt2"], ["speed", "gpt2", "--context", "1k"]])
def test_bad_plot_paths(tmp_path, capsys, command):
    for value, names, message in _bad_plots(tmp_path):
        one_line_error(capsys, [*command, "--plot", value], names, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no stray temporary or probe


@pytest.mark.slow
def test_plot_as_pdf_and_svg(tmp_path, capsys):
    assert main(["roofline", "gpt2", "--plot", str(tmp_path / "r.pdf")]) == 0
    assert main(["speed", "gpt2", "--context", "1k", "--plot", str(tmp_path / "s.svg")]) == 0
    assert (tmp_path / "r.pdf").read_bytes()[:5] == b"%PDF-"
    assert b"<svg" in (tmp_path / "s.svg").read_bytes()[:1000]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.pdf", "s.svg"]


def test_bench_checks_save_and_plot_before_measuring(tmp_path, capsys):
    pytest.importorskip("torch")
    (tmp_path / "afile").write_text("")
    one_line_error(capsys, ["bench", "gqa", "--save", str(tmp_path)], str(tmp_path), "is a directory")
    one_line_error(capsys, ["bench", "gqa", "--save", str(tmp_path / "afile" / "r.json")], "afile",
                   "is a file, not a folder")
    one_line_error(capsys, ["bench", "gqa", "--plot", str(tmp_path / "b.jpg")], "b.jpg", "extension '.jpg'")
    if HAS_PROC:
        one_line_error(capsys, ["bench", "gqa", "--save", "/proc/b.json"], "/proc/b.json", "does not take new files")


def test_calibrate_out_checked_before_measuring(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    one_line_error(capsys, ["calibrate", "--quick", "--out", str(tmp_path / "afile" / "p.json")], "afile",
                   "is a file, not a folder")
    one_line_error(capsys, ["calibrate", "--quick", "--out", ""], "--out", "is empty")
    one_line_error(capsys, ["calibrate", "--quick", "--out", "~kvwall-nosuchuser/p.json"], "~kvwall-nosuchuser",
                   "no user")
    if HAS_PROC:
        one_line_error(capsys, ["calibrate", "--quick", "--out", "/proc/p.json"], "/proc/p.json",
                       "does not take new files")


# -- report --------------------------------------------------------------------

def test_report_out_empty_leaves_the_users_report_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.md").write_text("my own notes")
    one_line_error(capsys, ["report", "--no-measure", "--out", ""], "--out", "is empty")
    one_line_error(capsys, ["report", "--no-measure", "--out", "."], "report.md", "did not write")
    assert (tmp_path / "report.md").read_text() == "my own notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_report_bad_folders(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    one_line_error(capsys, ["report", "--no-measure", "--out", str(tmp_path / "afile" / "r")], "afile",
                   "is a file, not a folder")
    one_line_error(capsys, ["report", "--no-measure", "--out", "~kvwall-nosuchuser/r"], "~kvwall-nosuchuser",
                   "no user")
    if HAS_PROC:
        one_line_error(capsys, ["report", "--no-measure", "--out", "/proc/r"], "/proc/r", "cannot create")


@pytest.mark.slow
def test_report_writes_again_into_its_own_folder(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", "--no-measure", "--out", str(out), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (out / ".kvwall-report").is_file()
    assert main(["report", "--no-measure", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["figures"] == first["figures"]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([".kvwall-report", "report.html", "report.md"] + [Path(f).name for f in first["figures"]])


@pytest.mark.slow
def test_two_reports_into_one_folder_at_once(tmp_path):
    """Both finish, or one refuses in one line; never a traceback, never a temporary left behind."""
    out = tmp_path / "rep"
    cmd = [sys.executable, "-m", "kvwall", "report", "--no-measure", "--json", "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    for rc, err in results:
        assert "Traceback" not in err
        assert rc == 0 or (rc == 2 and err.count("\n") == 1 and str(out) in err), err
    assert any(rc == 0 for rc, _ in results)
    assert "</html>" in (out / "report.html").read_text()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".part") or p.name.startswith(".kvwall-probe")]


def test_claim_folder_sees_past_a_report_starting_beside_it(tmp_path):
    """Another report's marker temporary or probe is not a user's file; anything else is."""
    from kvwall.errors import KvwallError
    from kvwall.report.build import MARKER, claim_folder

    out = tmp_path / "rep"
    out.mkdir()
    (out / f".{MARKER}.x1.part").write_text("")
    (out / ".kvwall-probe-x2").write_text("")
    assert claim_folder(str(out)) == out and (out / MARKER).is_file()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(KvwallError, match="notes.txt"):
        claim_folder(str(other))
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
