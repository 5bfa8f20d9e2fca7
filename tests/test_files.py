"""kvwall.files: atomic writes through unique temporaries, and output paths checked before any work."""

import json
import os
from pathlib import Path

import pytest

from kvwall.errors import KvwallError
from kvwall.files import PLOT_EXTS, check_folder, check_output, replacing, write_text


def test_write_replaces_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")
    write_text(target, json.dumps({"a": 1}))
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_written_file_has_the_usual_mode(tmp_path):
    """mkstemp makes 0600 files; the result gets what open() would give (0666 less the umask)."""
    mask = os.umask(0o022)
    try:
        write_text(tmp_path / "x.md", "x")
    finally:
        os.umask(mask)
    assert (tmp_path / "x.md").stat().st_mode & 0o777 == 0o644


def test_failure_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "r.md"
    target.write_text("the user's")
    with pytest.raises(ZeroDivisionError):
        with replacing(target) as f:
            f.write(b"half")
            _ = 1 / 0
    assert target.read_text() == "the user's"
    assert [p.name for p in tmp_path.iterdir()] == ["r.md"]


def test_two_writers_of_one_file_use_two_temporaries(tmp_path):
    """The old fixed `.part` name let two writers clash; unique names let both finish, one whole file wins."""
    target = tmp_path / "report.html"
    with replacing(target) as a, replacing(target) as b:
        assert a.name != b.name
        a.write(b"first")
        b.write(b"second")
    assert target.read_bytes() in (b"first", b"second")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_write_into_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(KvwallError, match="cannot write .*nope"):
        write_text(tmp_path / "nope" / "x.md", "x")


@pytest.mark.parametrize("make, name, exts, message", [
    (lambda d: d, "", None, "is a directory"),
    (lambda d: d, "x.txt", PLOT_EXTS, "extension '.txt'"),
    (lambda d: d, "x", PLOT_EXTS, "no extension"),
    (lambda d: d / "missing", "x.png", PLOT_EXTS, "does not exist"),
    (lambda d: _file(d / "f"), "x.png", PLOT_EXTS, "is a file, not a folder"),
    (lambda d: _file(d / "f") / "a" / "b", "x.png", PLOT_EXTS, "is a file, not a folder"),
])
def test_check_output_refuses(tmp_path, make, name, exts, message):
    path = make(tmp_path) / name if name else make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(KvwallError, match=message) as e:
        check_output(path, exts, option="--plot")
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no probe or temporary left behind


def _file(p: Path) -> Path:
    p.write_text("")
    return p


def test_check_output_accepts_and_leaves_no_probe(tmp_path):
    for ext in PLOT_EXTS + (".PNG",):
        assert check_output(tmp_path / f"x{ext}", PLOT_EXTS) == tmp_path / f"x{ext}"
    assert check_output(tmp_path / "a" / "b.json", make_parents=True) == tmp_path / "a" / "b.json"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a"]


def test_home_of_no_such_user_and_empty_paths():
    with pytest.raises(KvwallError, match="no user 'kvwall-nosuchuser'"):
        check_output("~kvwall-nosuchuser/x.png", PLOT_EXTS)
    with pytest.raises(KvwallError, match="--out is empty"):
        check_folder("")
    with pytest.raises(KvwallError, match="--save is empty"):
        check_output(" ", option="--save")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_a_folder_that_takes_no_files():
    """Root passes os.access() everywhere; only creating a file shows that /proc takes none."""
    with pytest.raises(KvwallError, match="/proc/x.png: the folder /proc does not take new files"):
        check_output("/proc/x.png", PLOT_EXTS)



@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
def test_a_device_is_not_replaced():
    """An atomic rename over /dev/null (as root) would replace the device itself."""
    with pytest.raises(KvwallError, match="/dev/null exists and is not a regular file"):
        check_output("/dev/null")
