"""`kvwall validate` (ideal mode; expected mode in test_expected.py): one row reproduced by hand from public
numbers, the summary on a tiny synthetic table, the rate convention for time metrics, filters, bad inputs and the
JSON's keys."""

import json

import pytest

from kvwall import catalog
from kvwall.cli import main
from kvwall.errors import KvwallError
from kvwall.predict.validate import predict_row, select, summarize, validate

# Llama-2-7B (config.json on the hub): hidden 4096, intermediate 11008, 32 layers, 32 KV heads x 128, vocab 32000,
# untied LM head. Weights read per decode step in bf16: 32 x (4 x 4096^2 attention + 3 x 4096 x 11008 MLP)
# + the 32000 x 4096 LM head (the embedding lookup reads one row), 2 bytes each.
HAND_WEIGHT_BYTES = (32 * (4 * 4096 ** 2 + 3 * 4096 * 11008) + 32000 * 4096) * 2  # 13,214,154,752
# The cache read at the middle of gpt-fast's run: prompt 5 + 200 / 2 = 105 tokens, K and V, 32 layers, bf16.
HAND_KV_BYTES = 105 * 32 * 2 * 4096 * 2  # 55,050,240
A100_BW = 2039e9  # A100 80GB SXM datasheet, bytes/s
HAND_TPOT = (HAND_WEIGHT_BYTES + HAND_KV_BYTES) / A100_BW  # 6.508 ms -> 153.7 tok/s


def _row(row_id: str) -> dict:
    return next(r for r in catalog.measurements() if r["id"] == row_id)


GPTFAST = "gptfast-a100-llama2-7b-bf16"


def test_gptfast_llama2_7b_by_hand():
    r = predict_row(_row(GPTFAST))
    assert r["decode_context"] == 105
    assert r["predicted"] == pytest.approx(1 / HAND_TPOT, rel=1e-3)  # 153.7 tok/s
    # published 104.9 tok/s: the ideal roofline is 46 % too fast, as issue 15 reports
    assert r["error"] == pytest.approx(1 / HAND_TPOT / 104.9 - 1, rel=1e-2)
    assert 0.45 < r["error"] < 0.47


def test_time_metric_compared_as_rate():
    """A TPOT twice the predicted one: the prediction is twice as fast, error +100 %."""
    row = dict(_row(GPTFAST), metric="tpot_s", value=2 * HAND_TPOT)
    r = predict_row(row)
    assert r["predicted"] == pytest.approx(HAND_TPOT, rel=1e-3)
    assert r["error"] == pytest.approx(1.0, rel=1e-2)


def test_throughput_formula_and_replicas():
    """batch x output / (TTFT + output x TPOT), times the data-parallel copies (n_devices / tp), by hand: batch 4
    on 2 A100s (2 copies) of 200 tokens. TPOT reads the weights once and four caches of 105 tokens:
    (13,214,154,752 + 4 x 55,050,240) / 2039 GB/s = 6.589 ms; TTFT (4 x 5 prompt tokens: 2.7e11 FLOPs, 0.9 ms at
    312 TFLOP/s, under the weights' 6.481 ms read) is memory-bound: 6.481 ms. 2 x 4 x 200 / (6.481 ms + 200 x
    6.589 ms) = 1,208 tok/s. The roofline's per-op detail (norms, activations) adds < 0.5 % to both."""
    tpot = (HAND_WEIGHT_BYTES + 4 * HAND_KV_BYTES) / A100_BW
    ttft = HAND_WEIGHT_BYTES / A100_BW
    assert tpot == pytest.approx(6.589e-3, rel=1e-3) and ttft == pytest.approx(6.481e-3, rel=1e-3)
    row = dict(_row(GPTFAST), metric="throughput_tok_s", value=100.0, batch=4, n_devices=2)
    r = predict_row(row)
    assert r["tpot_s"] == pytest.approx(tpot, rel=5e-3) and r["ttft_s"] == pytest.approx(ttft, rel=1e-2)
    assert r["predicted"] == pytest.approx(2 * 4 * 200 / (ttft + 200 * tpot), rel=5e-3)  # 1,208 tok/s
    assert r["predicted"] == pytest.approx(1208, rel=5e-3)
    assert r["error"] == pytest.approx(1208 / 100.0 - 1, rel=5e-3)  # measured 100 tok/s (made up)


def test_null_batch_skipped_with_reason():
    r = predict_row(dict(_row(GPTFAST), batch=None))
    assert "error" not in r and "batch" in r["skipped"]


@pytest.mark.slow
def test_every_catalog_row_predicted_or_skipped_for_its_batch():
    """Each row resolves to a catalog model and device; the only skips are the server-style runs."""
    data = validate(catalog.measurements())
    for r in data["rows"]:
        assert "error" in r or r["skipped"].startswith("batch not fixed"), r
        if "error" in r:
            assert r["predicted"] > 0


def _fake(i, engine, device, error):
    return {"id": f"r{i}", "engine": engine, "device": device, "error": error}


def test_summary_on_a_synthetic_table():
    results = [_fake(1, "a", "x", 0.1), _fake(2, "a", "y", -0.3), _fake(3, "a", "x", 0.2),
               _fake(4, "b", "y", 0.5), {"id": "r5", "engine": "b", "device": "y", "skipped": "why"}]
    s = summarize(results)
    assert (s["checked"], s["skipped"]) == (4, 1)
    a = s["engines"]["a"]
    assert a["n"] == 3 and a["median_abs_error"] == pytest.approx(0.2) and a["median_error"] == pytest.approx(0.1)
    assert a["max_abs_error"] == pytest.approx(0.3) and a["worst"] == "r2"
    assert s["devices"]["y"]["median_abs_error"] == pytest.approx(0.4)  # |-0.3|, 0.5
    assert s["all"]["median_abs_error"] == pytest.approx(0.25) and s["all"]["worst"] == "r4"


def test_select_filters_case_insensitive_and_unknown():
    rows = catalog.measurements()
    trt = select(rows, engine="tensorrt-llm", device="L40S")
    assert trt and all(r["engine"] == "TensorRT-LLM" and r["device"] == "l40s" for r in trt)
    with pytest.raises(KvwallError, match="known: .*gpt-fast"):
        select(rows, engine="nope")


@pytest.mark.parametrize("argv,what", [(["--engine", "nope"], "engine 'nope'"),
                                       (["--device", "tpu-v9"], "device 'tpu-v9'"),
                                       (["--plot", "out.txt"], "--plot")])
def test_bad_inputs_one_line(capsys, argv, what):
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwall: error:") and what in err and err.count("\n") == 1


@pytest.mark.slow
def test_json_keys(capsys):
    assert main(["validate", "--engine", "gpt-fast", "--json", "--mode", "ideal"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"conventions", "rows", "summary", "mode", "summaries", "fit"} and data["mode"] == "ideal"
    assert set(data["summary"]) == {"checked", "skipped", "all", "engines", "devices", "sources", "bands"}
    assert list(data["summary"]["engines"]) == ["gpt-fast"]
    row = next(r for r in data["rows"] if r["id"] == GPTFAST)
    assert {"measured", "predicted", "error", "tpot_s", "decode_context", "compute_dtype"} <= set(row)


@pytest.mark.slow
def test_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "v.png"
    assert main(["validate", "--device", "l40s", "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "trtllm-l40s-llama2-7b-ttft-128" in text and "device l40s" in text
    assert out.stat().st_size > 1000
