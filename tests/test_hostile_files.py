"""Issue #38, files and profiles: a user's file is never overwritten by one kvwall did not write, the installed
package is never written by a command a user runs, an unusable home is one line, and a profile's figures are
checked against plausible ranges where it is loaded. Nothing here measures: calibrate and the fit are replaced
by stand-ins that record whether they ran."""

import hashlib
import json
from pathlib import Path

import pytest
from cli_checks import assert_one_line, run_cli

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.files import home
from kvwall.predict.devices import PLAUSIBLE, _profile_problem, get_device

M = "llama-3.2-1b"

# A profile shaped as `kvwall calibrate` writes it (figures of benchmarks/results/validate_serving_profile_1903.json,
# rounded), built by hand: it must load.
PROFILE = {
    "vendor": "AuthenticAMD", "arch": "AMD EPYC", "year": None, "kind": "cpu", "memory_bytes": 25276203008,
    "memory_tech": None, "memory_bandwidth_Bps": 23.1e9,
    "peak_flops": {"fp32": 120e9, "fp64": 54.9e9, "bf16": 1.12e9, "fp16": 1.14e9}, "onchip_cache_bytes": 33554432,
    "interconnect": {"name": "none (this machine alone)", "bandwidth_Bps": None, "per_direction_Bps": None},
    "tdp_W": None, "layer_overhead_s": 2.9e-4,
    "op_bandwidth_Bps": {"matmul": 19.6e9, "attention": 18.0e9, "attention:int8": 3.3e9, "attention:int2": 1.05e9},
    "step_overhead_s": 2.4e-4, "mixer_overhead_s": {"latent": 1.7e-3, "mamba": 1.5e-3, "mamba2": 1.7e-3},
    "op_flops": {"attention": 21.3e9, "attention:prefill": 78.1e9, "latent": 53.4e9},
    "op_fixed_s": {"matmul": 7.5e-5, "attention:int8": 2.7e-4, "matmul:int4": 1.6e-5},
    "matmul_rows_Bps": {"1": 19.6e9, "16": 8.3e9, "256": 0.72e9},
    "packed_rows_Bps": {"matmul:int4": {"1": 8.8e9, "16": 0.72e9}},
    "prefill_attention_flops": {"128": 20.4e9, "2048": 78.1e9},
    "packed_overhead_s": {"matmul:int4": 2.7e-4, "matmul:int8": 0.0}, "unfused_overhead_s": 3.3e-4,
    "paged_pool": {"fixed_s": 0.0, "s_per_byte": 2.4e-11},
    "runner_step": {"fixed_s": 1.7e-3, "per_row_s": 4.0e-4, "slowdown": 0.11},
    "source": "measured by `kvwall calibrate` on vm at 2026-12-04T19:02:09+00:00", "unconfirmed": [], "notes": [],
    "busy_warning": None,
}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def no_measuring(monkeypatch):
    """calibrate's measurement replaced: records each call, returns a stand-in whose profile is PROFILE."""
    from kvwall.measure import calibrate as calibrate_module

    calls = []

    class Cal:
        def profile(self):
            return dict(PROFILE)

    def fake(quick=False, progress=None):
        calls.append(quick)
        return Cal()

    monkeypatch.setattr(calibrate_module, "calibrate", fake)
    return calls


# -- 1. calibrate --out: never over a file that is not a profile, checked before measuring -------------------

def test_calibrate_refuses_a_text_file_before_measuring(tmp_path, monkeypatch, capsys, no_measuring):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    rc, _, err = run_cli(["calibrate", "--quick", "--out", notes], capsys)
    assert_one_line(rc, err, str(notes), "not a kvwall device profile")
    assert no_measuring == []  # refused before measuring
    assert notes.read_text() == "my notes\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("content", [b"", b"[1, 2]", b'{"memory_bandwidth_Bps": 1e10}', b"\xff\xfe binary"],
                         ids=["empty", "a list", "half a profile", "not utf-8"])
def test_calibrate_refuses_other_json_and_bytes(content, tmp_path, monkeypatch, capsys, no_measuring):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    target = tmp_path / "data.json"
    target.write_bytes(content)
    rc, _, err = run_cli(["calibrate", "--quick", "--out", target], capsys)
    assert_one_line(rc, err, "not a kvwall device profile")
    assert target.read_bytes() == content and no_measuring == []


def test_calibrate_replaces_an_existing_profile_whole(tmp_path, monkeypatch, capsys, no_measuring):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    target = tmp_path / "old.json"
    target.write_text(json.dumps({**PROFILE, "memory_bandwidth_Bps": 5e9}))  # an older profile: calibrate's job
    rc, _, err = run_cli(["calibrate", "--quick", "--json", "--out", target], capsys)
    assert rc == 0, err
    assert json.loads(target.read_text())["memory_bandwidth_Bps"] == 23.1e9
    assert no_measuring == [True] and sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # no temp left


def test_calibrate_replaces_a_damaged_local_profile(tmp_path, monkeypatch, capsys, no_measuring):
    """The damaged-profile error says `run kvwall calibrate again`: that must work on kvwall's own file."""
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text("{ half written")
    rc, _, err = run_cli(["memory", M, "--device", "local"], capsys)
    assert_one_line(rc, err, "local profile", "kvwall calibrate")
    assert run_cli(["calibrate", "--quick", "--json"], capsys)[0] == 0
    assert get_device("local").bandwidth == 23.1e9


def test_calibrate_checks_the_folder_before_measuring(tmp_path, monkeypatch, capsys, no_measuring):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, _, err = run_cli(["calibrate", "--quick", "--out", blocker / "p.json"], capsys)
    assert_one_line(rc, err, str(blocker), "is a file, not a folder")
    assert no_measuring == [] and blocker.read_text() == "x"


# -- 2. validate --fit: options first, and never into the package --------------------------------------------

@pytest.fixture
def package_unchanged():
    before = digest(catalog.EFFICIENCY_FILE)
    yield
    assert digest(catalog.EFFICIENCY_FILE) == before


@pytest.fixture
def no_fitting(monkeypatch):
    """The fit (a minute) and the scoring replaced: the fit returns the packaged table's content, the scoring
    returns what the run reads (fit_info: which table expected mode uses)."""
    from kvwall.predict import validate as scoring  # what kvwall.api.validate (the command's body) calls
    from kvwall.predict.validate import fit_info

    calls = []
    packaged = json.loads(catalog.EFFICIENCY_FILE.read_text())
    monkeypatch.setattr(scoring, "refit", lambda rows: calls.append(len(rows)) or {**packaged, "date": "fit"})
    monkeypatch.setattr(scoring, "validate", lambda *a: {"fit": fit_info(), "rows": []})
    return calls


def test_validate_fit_refuses_an_unknown_engine_before_fitting(tmp_path, monkeypatch, capsys, package_unchanged,
                                                              no_fitting):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    rc, _, err = run_cli(["validate", "--fit", "--engine", "nosuch"], capsys)
    assert_one_line(rc, err, "engine 'nosuch'")
    assert no_fitting == [] and list(tmp_path.iterdir()) == []


def test_validate_fit_writes_kvwall_home_and_expected_mode_reads_it(tmp_path, monkeypatch, capsys,
                                                                   package_unchanged, no_fitting):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    rc, out, err = run_cli(["validate", "--fit", "--json"], capsys)
    assert rc == 0, err
    mine = tmp_path / "home" / "efficiency.json"
    data = json.loads(out)
    assert data["fit_written"] == str(mine) and json.loads(mine.read_text())["date"] == "fit"
    assert data["fit"]["file"] == str(mine) and data["fit"]["date"] == "fit"
    assert catalog.efficiency_file() == mine
    rc, out, err = run_cli(["speed", M, "--device", "h100", "--json"], capsys)
    assert rc == 0, err
    assert f"table {mine}, your `kvwall validate --fit`" in json.loads(out)["mode_text"]


def test_validate_fit_out_refuses_a_file_it_did_not_write(tmp_path, monkeypatch, capsys, package_unchanged,
                                                          no_fitting):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    other = tmp_path / "results.json"
    other.write_text('{"mine": 1}')
    rc, _, err = run_cli(["validate", "--fit", "--out", other], capsys)
    assert_one_line(rc, err, str(other), "not a kvwall fitted efficiency table")
    assert other.read_text() == '{"mine": 1}' and no_fitting == []
    rc, _, err = run_cli(["validate", "--out", tmp_path / "x.json"], capsys)  # --out without --fit
    assert_one_line(rc, err, "--out", "--fit")


def test_validate_fit_out_replaces_a_table(tmp_path, monkeypatch, capsys, package_unchanged, no_fitting):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    target = tmp_path / "eff.json"
    target.write_text(json.dumps({"params": {}, "table_version": "old"}))
    assert run_cli(["validate", "--fit", "--json", "--out", target], capsys)[0] == 0
    assert json.loads(target.read_text())["date"] == "fit"
    assert not (tmp_path / "home" / "efficiency.json").exists()  # written where told, nowhere else


def test_a_fit_of_an_older_table_is_passed_over_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    mine = tmp_path / "efficiency.json"
    mine.write_text(json.dumps({"params": {}, "table_version": "000000000000"}))
    assert catalog.efficiency_file() == catalog.EFFICIENCY_FILE
    assert "older measurements table, not used" in catalog.efficiency_source()


@pytest.mark.parametrize("content", ["[]", "{ not json"])
def test_a_damaged_user_fit_is_one_line(content, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "efficiency.json").write_text(content)
    rc, _, err = run_cli(["speed", M, "--device", "h100"], capsys)
    assert_one_line(rc, err, str(tmp_path / "efficiency.json"), "kvwall validate --fit")


# -- 3. a home that cannot be determined -------------------------------------------------------------------

def test_kvwall_home_of_no_such_user(tmp_path, monkeypatch, capsys, no_measuring):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVWALL_HOME", "~kvwall-nosuchuser/x")
    for argv in (["calibrate", "--quick"], ["memory", M, "--device", "local"], ["speed", M, "--device", "h100"]):
        rc, _, err = run_cli(argv, capsys)
        assert_one_line(rc, err, "KVWALL_HOME", "~kvwall-nosuchuser/x")
    assert no_measuring == [] and list(tmp_path.iterdir()) == []  # no folder named "~kvwall-nosuchuser" made here
    rc, _, err = run_cli(["calibrate", "--quick", "--out", "~kvwall-nosuchuser/x"], capsys)
    assert_one_line(rc, err, "--out", "~kvwall-nosuchuser/x")


def test_no_home_directory_at_all(monkeypatch, capsys):
    """No $HOME and no password entry: Path.home() raises RuntimeError; kvwall says to set KVWALL_HOME."""
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("KVWALL_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(KvwallError, match="set KVWALL_HOME"):
        home()
    rc, _, err = run_cli(["memory", M, "--device", "local"], capsys)
    assert_one_line(rc, err, "home directory", "KVWALL_HOME")
    assert run_cli(["calibrate", "--help"], capsys)[0] == 0  # the parser itself never resolves the home


# -- 4. the local profile's figures: plausible, whichever command reads it --------------------------------

def test_a_real_profile_shape_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text(json.dumps(PROFILE))
    d = get_device("local")
    assert d.bandwidth == 23.1e9 and d.flops("fp32") == 120e9 and d.runner_step["slowdown"] == 0.11
    rc, out, err = run_cli(["roofline", M, "--device", "local", "--json"], capsys)
    assert rc == 0, err


ABSURD = [  # (field, value, the name the message gives it)
    ("peak_flops", {"fp32": 1e-300}, "peak_flops.fp32"),
    ("layer_overhead_s", 1e9, "layer_overhead_s"),
    ("memory_bandwidth_Bps", 1e300, "memory_bandwidth_Bps"),
    ("memory_bandwidth_Bps", 20, "memory_bandwidth_Bps"),  # GB/s written where B/s belong
    ("op_bandwidth_Bps", {"matmul": 1e300}, "op_bandwidth_Bps.matmul"),
    ("matmul_rows_Bps", {"1": 1e-5}, "matmul_rows_Bps.1"),
    ("packed_rows_Bps", {"matmul:int4": {"1": 1e20}}, "packed_rows_Bps.matmul:int4.1"),
    ("prefill_attention_flops", {"128": 1e30}, "prefill_attention_flops.128"),
    ("mixer_overhead_s", {"mamba": 86400.0}, "mixer_overhead_s.mamba"),
    ("paged_pool", {"fixed_s": 0.0, "s_per_byte": 1.0}, "paged_pool.s_per_byte"),
    ("runner_step", {"per_row_s": 1e-4, "slowdown": 1e6}, "runner_step.slowdown"),
    ("memory_bytes", 1e300, "memory_bytes"),
    ("tdp_W", 1e12, "tdp_W"),
    ("interconnect", {"per_direction_Bps": 1e300}, "interconnect.per_direction_Bps"),
    ("mixer_overhead_s", {"mamba": None}, "mixer_overhead_s.mamba"),
]


@pytest.mark.slow
@pytest.mark.parametrize("field, value, name", ABSURD, ids=[f"{n}={v!r:.20}" for _, v, n in ABSURD])
def test_an_absurd_figure_is_refused_where_the_profile_loads(field, value, name, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    path = tmp_path / "local-device.json"
    path.write_text(json.dumps({**PROFILE, field: value}))
    before = digest(path)
    for argv in (["roofline", M, "--device", "local"], ["speed", M, "--device", "local"],
                 ["memory", M, "--device", "local"], ["simulate", M, "--device", "local", "--rate", "1"]):
        rc, _, err = run_cli(argv, capsys)
        assert_one_line(rc, err, str(path), repr(name), "kvwall calibrate")
    assert digest(path) == before


def test_the_message_names_the_value_and_the_range(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text(json.dumps({**PROFILE, "peak_flops": {"fp32": 1e-300}}))
    rc, _, err = run_cli(["roofline", M, "--device", "local"], capsys)
    assert_one_line(rc, err, "'peak_flops.fp32' is 1e-300, outside the plausible 1e+06 to 1e+17 (FLOP/s)",
                    "run `kvwall calibrate` again")


@pytest.mark.parametrize("unit, inside, outside", [
    ("B/s", [1e6, 7.7e12, 1e14], [9.9e5, 1.01e14]), ("FLOP/s", [1e6, 9e15], [1e5, 2e17]),
    ("s", [0.0, 1.0], [-1e-9, 1.5]), ("s/B", [0.0, 2.4e-11], [2e-6]), ("share", [0.0, 0.15], [11.0]),
])
def test_the_ranges_by_hand(unit, inside, outside):
    """Each unit's bounds, at and past its ends (datasheet B200: 7.7e12 B/s, 9e15 FLOP/s dense fp4)."""
    lo, hi = PLAUSIBLE[unit]
    assert all(lo <= v <= hi for v in inside) and not any(lo <= v <= hi for v in outside)


def test_every_catalog_device_is_plausible():
    """The ranges admit every datasheet figure in catalog/devices.json (B200's 9e15 FLOP/s, MI300X's 5.3e12 B/s,
    cpu-generic's 1.5 TB of memory); apple-m3-max lists no peak, which only a profile must have."""
    for name, entry in catalog.devices_table().items():
        if not any((entry.get("peak_flops") or {}).values()):
            entry = {**entry, "peak_flops": {"fp32": 1e12}}
        assert _profile_problem(entry) is None, name
