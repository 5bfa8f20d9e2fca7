"""`kvwall calibrate --quick`: one real (few-second) calibration, then checks on the profile it saved."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("numpy")

from kvwall.cli import main
from kvwall.errors import KvwallError
from kvwall.measure import machine
from kvwall.measure.calibrate import save_profile
from kvwall.predict.devices import get_device, profile_path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """Run `kvwall calibrate --quick --json` once with KVWALL_HOME in a temp dir; return (printed JSON, home)."""
    home = tmp_path_factory.mktemp("kvwall-home")
    out = io.StringIO()  # capsys is function-scoped
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setenv("KVWALL_HOME", str(home))
        assert main(["calibrate", "--quick", "--json"]) == 0
    return json.loads(out.getvalue()), home


def test_profile_saved_where_local_device_looks(calibrated, monkeypatch):
    printed, home = calibrated
    monkeypatch.setenv("KVWALL_HOME", str(home))
    assert Path(printed["profile_path"]) == profile_path() == home / "local-device.json"
    saved = json.loads(profile_path().read_text())
    assert saved["memory_bandwidth_Bps"] == printed["memory_bandwidth_Bps"]
    assert list(home.iterdir()) == [profile_path()]  # no temp file left behind
    d = get_device("local")
    assert d.name == "local" and d.bandwidth == saved["memory_bandwidth_Bps"]
    assert d.flops("fp32") == saved["peak_flops"]["fp32"]
    assert d.balance("fp32") > 0


def test_bandwidths_are_physically_plausible(calibrated):
    m = calibrated[0]["measured"]
    for key in ("read_bandwidth_Bps", "copy_bandwidth_Bps", "gemv_bandwidth_Bps"):
        assert 0.5e9 < m[key] < 1e12, key
    for r in m["results"]:
        assert len(r["runs_s"]) == m["settings"]["runs" if r["kind"] != "gemm" else "gemm_runs"]
        assert r["median_s"] > 0
        assert 0.0 <= r["others_cpu_share"] <= 1.0  # how much of the machine others took meanwhile


def test_gemm_beats_gemv(calibrated):
    printed = calibrated[0]
    gemv_fp32 = max(r["flops"] for r in printed["measured"]["results"] if r["kind"] == "gemv" and r["dtype"] == "fp32")
    assert printed["peak_flops"]["fp32"] > gemv_fp32
    assert printed["peak_flops"]["fp64"] > 0


def test_memory_is_what_the_os_says(calibrated):
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        pytest.skip("no /proc/meminfo here")
    kib = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text()).group(1))
    assert calibrated[0]["memory_bytes"] == kib * 1024


def test_measured_section_says_how(calibrated):
    m = calibrated[0]["measured"]
    assert m["quick"] is True and m["seconds"] > 0
    assert m["cpu_model"] and m["hostname"] and m["versions"]["numpy"]
    assert m["read_method"] in {r["method"] for r in m["results"] if r["kind"] == "read"}
    kinds = {r["kind"] for r in m["results"]}
    assert kinds == {"read", "copy", "gemv", "gemm"}


def test_unwritable_out_fails_before_measuring(tmp_path, capsys):
    assert main(["calibrate", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err  # one line, and no progress: nothing was measured


def test_save_profile_errors_are_one_line(tmp_path):
    with pytest.raises(KvwallError, match="is a directory"):
        save_profile({}, tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KvwallError, match="cannot write the profile"):
        save_profile({}, blocker / "sub" / "local-device.json")


def test_save_profile_replaces_atomically(tmp_path):
    target = tmp_path / "p.json"
    target.write_text("old")
    save_profile({"a": 1}, target)
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_damaged_profile_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text("{ not json")
    with pytest.raises(KvwallError, match="run `kvwall calibrate` again"):
        get_device("local")


def test_cache_sizes_parse():
    assert machine._parse_size("491520K") == 491520 * 1024
    assert machine._parse_size("2 MiB") == 2 * 2**20
    assert machine._parse_size("48K") == 48 * 1024
    assert machine._parse_size("") == 0


def test_engine_layer_overhead_measured(calibrated, monkeypatch):
    pytest.importorskip("torch")
    printed, home = calibrated
    # a decode step of a tiny 12-layer model costs microseconds to a few milliseconds per layer, never zero
    assert 1e-6 < printed["layer_overhead_s"] < 5e-2
    assert set(printed["mixer_overhead_s"]) == {"latent", "mamba", "mamba2"} and printed["step_overhead_s"] >= 0
    monkeypatch.setenv("KVWALL_HOME", str(home))
    assert get_device("local").layer_overhead_s == printed["layer_overhead_s"]


def test_op_bandwidths_measured(calibrated):
    pytest.importorskip("torch")
    ops = calibrated[0]["op_bandwidth_Bps"]
    assert set(ops) == {"matmul", "attention", "attention:int8", "attention:int4", "attention:int2"}
    assert all(0.5e9 < v < 1e12 for v in ops.values())
