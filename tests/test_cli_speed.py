"""roofline / speed / speculate on the command line: JSON numbers, plots, errors."""

import json
import subprocess
import sys

import pytest

from kvwall.cli import main


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_roofline_json_states_assumptions(capsys):
    data = run_json(capsys, "roofline", "llama-3-8b", "--device", "h100-sxm", "--batch", "1,8", "--context", "4k",
                    "--prompt", "2k")
    a = data["assumptions"]
    assert a["machine_balance"] == pytest.approx(989e12 / 3.35e12)
    assert a["compute_eff"] == 1.0 and a["mem_eff"] == 1.0 and "counted" in a
    b1, b8 = data["phases"]
    assert b1["decode"]["bound"] == "memory" and b1["prefill"]["bound"] == "compute"
    assert b8["tokens_per_s_total"] > b1["tokens_per_s_total"]
    assert b1["tokens_per_s_total"] == pytest.approx(1 / b1["tpot_s"])
    assert b1["energy_per_token"]["estimate"] is True


def test_roofline_kv_format_and_tp(capsys):
    base = run_json(capsys, "roofline", "llama-3-70b", "--tp", "4", "--context", "32k")
    fp8 = run_json(capsys, "roofline", "llama-3-70b", "--tp", "4", "--context", "32k", "--kv-format", "fp8")
    cache = lambda d: sum(o["cache_read"] for o in d["phases"][0]["decode"]["ops"])
    assert cache(fp8) == pytest.approx(cache(base) / 2)
    assert base["weights_fit"] is True


def test_roofline_and_speed_plots(tmp_path, capsys):
    png = tmp_path / "roof.png"
    assert main(["roofline", "gpt2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "roofline chart written" in capsys.readouterr().out
    png2 = tmp_path / "speed.png"
    data = run_json(capsys, "speed", "llama-3-8b", "mamba-2.8b", "--context", "1k,64k", "--plot", str(png2))
    assert png2.read_bytes()[:4] == b"\x89PNG"
    llama, mamba = data["models"]
    assert llama["decode"][1]["tpot_s"] > llama["decode"][0]["tpot_s"]
    assert mamba["decode"][1]["tpot_s"] == mamba["decode"][0]["tpot_s"]


def test_speculate_json(capsys):
    data = run_json(capsys, "speculate", "llama-3-70b", "--draft", "llama-3-8b", "--acceptance", "0.8",
                    "--k", "1,4", "--device", "h200")
    assert [r["k"] for r in data["rows"]] == [1, 4]
    assert data["rows"][0]["expected_tokens"] == pytest.approx(1.8)


@pytest.mark.parametrize("argv, message", [
    (["roofline", "gpt2", "--mem-eff", "1.5"], "--mem-eff"),
    (["roofline", "gpt2", "--batch", "0"], "bad batch"),
    (["roofline", "gpt2", "--device", "nope"], "unknown device"),
    (["speculate", "gpt2", "--draft", "gpt2", "--acceptance", "2"], "acceptance"),
    (["roofline", "gpt2", "--plot", "/no/such/dir/x.png"], "does not exist"),
])
def test_errors(argv, message):
    proc = subprocess.run([sys.executable, "-m", "kvwall", *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
