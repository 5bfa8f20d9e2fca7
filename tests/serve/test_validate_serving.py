"""benchmarks/validate_serving.py without a server: a row's error against hand numbers, and `--rows` printing
and plotting earlier --json files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import validate_serving as vs

MEASURED = {"request_throughput": 2.0, "output_token_throughput": 64.0, "ttft_s": {"p50": 0.25, "p99": 0.5},
            "tpot_s": {"p50": 0.040, "p99": 0.080}, "cached_prompt_tokens": 0}
SIMULATED = {"request_throughput": 2.2, "output_token_throughput": 70.4, "ttft_s": {"p50": 0.2, "p99": 0.6},
             "tpot_s": {"p50": 0.030, "p99": 0.080}, "preemptions": 0, "prefix_cached_tokens": 0}


def test_row_errors_by_hand():
    r = vs.row("16MiB", 2.0, MEASURED, SIMULATED)
    assert r["req/s"]["error"] == pytest.approx(0.10)  # 2.2 / 2.0 - 1
    assert r["TTFT p50"]["error"] == pytest.approx(-0.20) and r["TTFT p99"]["error"] == pytest.approx(0.20)
    assert r["TPOT p50"]["error"] == pytest.approx(-0.25) and r["TPOT p99"]["error"] == pytest.approx(0.0)


@pytest.mark.slow
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


def test_probe_times_a_decode_step_of_the_model(tiny_model, monkeypatch):
    """The probe loads the model by path and times its decode steps, the median after 4 warm-up ones: with a clock
    that the model moves by (i + 1) ms at its i-th decode step, the timed steps are 5 .. 28 ms and their median
    16.5 ms; a second call reuses the cache (never outgrown): steps 29 .. 56 ms, 33 .. 56 timed, median 44.5."""
    path, _ = tiny_model("llama")
    probe = vs.Probe(str(path))
    clock, steps, forward = [0.0], [0], probe.model

    def model(tokens, pos, cache, **kw):
        out = forward(tokens, pos, cache, **kw)
        if tokens.shape[1] == 1:  # a decode step (the prefill is untimed)
            steps[0] += 1
            clock[0] += steps[0] * 1e-3
        return out

    monkeypatch.setattr(probe, "model", model)
    monkeypatch.setattr(vs.time, "perf_counter", lambda: clock[0])
    assert vs.PROBE_STEPS == 24  # 24 timed + 4 warm-up steps a call
    assert probe.measure() == pytest.approx(16.5e-3) and probe.measure() == pytest.approx(44.5e-3)


def _samples(starts: list[float]) -> list[dict]:
    return [{"ok": True, "start": t, "prompt_tokens": 128, "output_tokens": 32} for t in starts]


def test_saturation_by_hand():
    """48 requests, the last arriving at 24 s: they arrived at 2.0 req/s. Done by 25 s (1.92 req/s, 96 %) the
    server kept up; done by 40 s (1.2 req/s, 60 %) it was saturated. Without samples nothing is known."""
    starts = [0.5 * i for i in range(1, 49)]  # 0.5 .. 24 s
    kept_up = vs.saturation({"samples": _samples(starts), "wall_s": 25.0})
    assert kept_up["arrival_rate"] == 2.0 and kept_up["completion_rate"] == pytest.approx(1.92)
    assert kept_up["ratio"] == pytest.approx(0.96) and kept_up["saturated"] is False
    behind = vs.saturation({"samples": _samples(starts), "wall_s": 40.0})
    assert behind["ratio"] == pytest.approx(0.6) and behind["saturated"] is True
    assert vs.saturation({"wall_s": 40.0}) is None  # a run saved before samples were kept


def test_throughput_is_scored_only_where_the_server_was_saturated(capsys):
    """Three hand-made rows: below saturation a throughput error of +40 % is not scored (n/a); saturated, +10 % is
    within 15 % and -20 % is not: throughput 1 of 2; TPOT (errors -25 %) and TTFT (-20 %) scored at all three:
    TPOT 0 of 3 within 15 %, TTFT 3 of 3 within 25 %. A row of unknown saturation is left out of throughput."""
    starts = [0.5 * i for i in range(1, 49)]
    light = {**MEASURED, "samples": _samples(starts), "wall_s": 25.0}
    heavy = {**MEASURED, "samples": _samples(starts), "wall_s": 40.0}
    rows = [vs.row("256MiB", 2.0, light, {**SIMULATED, "request_throughput": 2.8}),
            vs.row("16MiB", 2.0, heavy, SIMULATED),
            vs.row("16MiB", 8.0, heavy, {**SIMULATED, "request_throughput": 1.6})]
    assert [r["req/s"]["error"] for r in rows] == pytest.approx([0.4, 0.1, -0.2])
    got = vs.score(rows)
    assert (got["req/s"]["within"], got["req/s"]["scored"], got["req/s"]["left_out"]) == (1, 2, 1)
    assert (got["TPOT p50"]["within"], got["TPOT p50"]["scored"]) == (0, 3)
    assert (got["TTFT p50"]["within"], got["TTFT p50"]["scored"]) == (3, 3)
    vs.print_row(rows[0])
    vs.print_row(rows[1])
    out = capsys.readouterr().out
    assert "req/s 2.0/2.8 (n/a (not saturated))" in out and "req/s 2.0/2.2 (+10%)" in out
    unknown = vs.row("16MiB", 2.0, MEASURED, SIMULATED)  # no samples
    assert vs.score([unknown])["req/s"]["scored"] == 0 and vs.score([unknown])["TPOT p50"]["scored"] == 1


def test_rows_of_an_old_file_take_their_saturation_from_the_runs_saved_beside_it(tmp_path):
    starts = [0.5 * i for i in range(1, 49)]
    saved = tmp_path / "v_saved"
    saved.mkdir()
    (saved / "16MiB-2.json").write_text(json.dumps({"kv": "16MiB", "rate": 2.0, "measured": {
        **MEASURED, "samples": _samples(starts), "wall_s": 40.0}}))
    old = [{k: v for k, v in vs.row(kv, 2.0, MEASURED, SIMULATED).items() if k != "saturation"}
           for kv in ("16MiB", "256MiB")]
    rows = vs.with_saturation(old, saved)
    assert rows[0]["saturation"]["saturated"] is True and "saturation" not in rows[1]
