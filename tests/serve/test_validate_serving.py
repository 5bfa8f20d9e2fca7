"""benchmarks/validate_serving.py without a server: a row's error against hand numbers, and `--rows` printing
and plotting earlier --json files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import validate_serving as vs  # noqa: E402

MEASURED = {"request_throughput": 2.0, "output_token_throughput": 64.0, "ttft_s": {"p50": 0.25, "p99": 0.5},
            "tpot_s": {"p50": 0.040, "p99": 0.080}, "cached_prompt_tokens": 0}
SIMULATED = {"request_throughput": 2.2, "output_token_throughput": 70.4, "ttft_s": {"p50": 0.2, "p99": 0.6},
             "tpot_s": {"p50": 0.030, "p99": 0.080}, "preemptions": 0, "prefix_cached_tokens": 0}


def test_row_errors_by_hand():
    r = vs.row("16MiB", 2.0, MEASURED, SIMULATED)
    assert r["req/s"]["error"] == pytest.approx(0.10)  # 2.2 / 2.0 - 1
    assert r["TTFT p50"]["error"] == pytest.approx(-0.20) and r["TTFT p99"]["error"] == pytest.approx(0.20)
    assert r["TPOT p50"]["error"] == pytest.approx(-0.25) and r["TPOT p99"]["error"] == pytest.approx(0.0)


def test_rows_prints_and_plots_earlier_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    a = [vs.row(kv, rate, MEASURED, SIMULATED) | {"server": "kvwall"} for kv in ("16MiB", "256MiB")
         for rate in (0.5, 2.0)]
    b = [vs.row("32MiB", 2.0, MEASURED, SIMULATED)]  # an older file: no "server" key
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    png = tmp_path / "fig" / "v.png"
    monkeypatch.setattr(sys, "argv", ["validate_serving.py", "--rows", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}",
                                      "--plot", str(png)])
    vs.main()
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if line.startswith("kv ")]) == 5
    assert "TTFT p50 250.0/200.0 (-20%)" in out[0] and out[-1] == f"wrote {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("shared_prefix, expected", [(0, 0), (96, 64)])
def test_trace_shares_prefix_tokens_only_with_a_shared_prefix(tmp_path, monkeypatch, shared_prefix, expected):
    """Two random prompts may share a block's worth of leading words (one of 48 requests got 64 cached tokens in a
    run without --shared-prefix): that must not make every replayed request share them. With --shared-prefix,
    each request shares the most any request got from the server's cache."""
    import argparse

    samples = [{"ok": True, "start": 0.5 * i, "prompt_tokens": 128, "output_tokens": 32,
                "cached_tokens": 64 if i == 3 else 0} for i in range(6)]
    monkeypatch.setattr(vs, "kvwall_json", lambda argv: {"points": [SIMULATED]})
    args = argparse.Namespace(shared_prefix=shared_prefix, model="smollm2-135m", requests=6, vllm_python=None,
                              chunk=512, max_batch=64)
    trace = tmp_path / "trace.jsonl"
    assert vs.simulated(args, {"samples": samples}, "256MiB", 0.5, trace) == SIMULATED
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 6 and {line["shared_tokens"] for line in lines} == {expected}


def test_probe_error_by_hand_and_printed(capsys):
    """A probe step measured at 50 ms that the profile puts at 40 ms: the profile is 20 % fast (40 / 50 - 1)."""
    pr = vs.probe_row(0.050, 0.040)
    assert pr["error"] == pytest.approx(-0.20)
    assert vs.probe_row(None, 0.040) is None  # a run saved before the probe existed
    vs.print_row(vs.row("16MiB", 2.0, MEASURED, SIMULATED, pr))
    assert "probe step 50.0/40.0 ms (-20%)" in capsys.readouterr().out


def test_probe_times_a_decode_step_of_the_model(tiny_model):
    """The probe loads the model by path and times its decode steps: a positive median, the same model's step
    again after the first call (its cache is reused, never outgrown)."""
    path, _ = tiny_model("llama")
    probe = vs.Probe(str(path))
    first, second = probe.measure(), probe.measure()
    assert 0 < first < 1 and 0 < second < 1
