"""Where the C++ kernels build, and that a lock left by a killed build cannot hang the next run."""

import subprocess
import sys

import pytest

from kvwall.engine import native


def test_build_folder_is_named_by_sources_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    a = native.build_dir("selective_scan", ["-O3", "-mavx2"])
    assert a == native.build_dir("selective_scan", ["-O3", "-mavx2"])  # the same build is found again
    assert a != native.build_dir("selective_scan", ["-O3"])  # other flags: another folder
    assert a != native.build_dir("quantized_decode", ["-O3", "-mavx2"])  # another kernel: another folder
    assert a.parent == tmp_path / "kvwall" and a.name.startswith("selective_scan-")


def test_another_checkout_builds_in_its_own_folder(tmp_path, monkeypatch):
    """The same sources in another checkout (a CI clone beside the working tree) get another folder: torch writes
    the .cpp path into build.ninja, so a shared folder was rebuilt by each checkout in turn."""
    import shutil

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    here = native.build_dir("selective_scan", ["-O3"])
    clone = tmp_path / "clone" / "kernels"
    shutil.copytree(native.KERNELS, clone)
    monkeypatch.setattr(native, "KERNELS", clone)
    assert native.source("selective_scan").read_bytes() == (clone / "selective_scan.cpp").read_bytes()
    assert native.build_dir("selective_scan", ["-O3"]) != here


def test_build_lock_removes_a_stale_torch_lock(tmp_path):
    stale = tmp_path / "lock"
    stale.write_text("")  # what torch's FileBaton leaves when its build is killed
    with native.build_lock(tmp_path) as where:
        assert where == tmp_path and not stale.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="fcntl locks")
def test_a_killed_build_does_not_hang_the_next():
    """The bug: a build killed mid-way left torch's `lock` file, and every later `kvwall bench` waited on it
    (20 min, until someone removed it). torch takes that lock even when the build is up to date."""
    built = native.build("selective_scan", "the test's fallback")
    if built is None:
        pytest.skip("no C++ compiler here")
    stale = native.build_dir("selective_scan", built[1]) / "lock"
    stale.write_text("")
    code = "from kvwall.engine import native; print(native.build('selective_scan', 'x') is not None)"
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    finally:
        stale.unlink(missing_ok=True)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]
