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


def test_report_quick_measures(tmp_path, capsys, monkeypatch):
    """With the engine installed, --quick adds the measured section and its figure (bench shrunk for the test)."""
    import pytest

    pytest.importorskip("torch")
    from kvwall.report import measured

    home = tmp_path / "home"
    home.mkdir()
    (home / "local-device.json").write_text(json.dumps({"memory_bytes": 8 * 2**30, "memory_bandwidth_Bps": 20e9,
                                                        "peak_flops": {"fp32": 1e11}, "source": "test"}))
    monkeypatch.setenv("KVWALL_HOME", str(home))
    monkeypatch.setattr(measured, "QUICK", {"contexts": [128], "steps": 1, "prefill_max": 128})
    monkeypatch.setattr("kvwall.measure.archs.QUICK", ["gqa"])
    out = tmp_path / "rep"
    assert main(["report", "--quick", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured"] is True
    html = (out / "report.html").read_text()
    assert "<figure id='measured-vs-predicted'>" in html and "Measured on" in html
