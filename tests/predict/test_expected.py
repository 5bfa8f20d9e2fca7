"""Expected mode: one row by hand under given figures, the stored fit against the table (leave-one-out),
leave-one-out on a tiny synthetic table whose answer is known, `local` keeps its calibration, --ideal keeps
today's numbers, and the fit warning."""

import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from kvwall import catalog
from kvwall.cli import main
from kvwall.predict.devices import get_device
from kvwall.predict.expected import PARAMS, device_class, expected_roof, fitted
from kvwall.predict.expected_fit import fit, leave_one_out
from kvwall.predict.memory import Formats
from kvwall.predict.roofline import Roof, decode
from kvwall.predict.table import figures, prepare
from kvwall.predict.validate import OUTLIER, predict_row, validate
from kvwall.spec.resolve import load_spec

ROWS = {r["id"]: r for r in catalog.measurements()}
GPTFAST = "gptfast-a100-llama2-7b-bf16"
# Given figures (not the fitted ones), so that the arithmetic below is independent of the fit.
GIVEN = {k: 1.0 for k in PARAMS} | {"bw_weights": 0.5, "bw_cache": 0.25, "compute": 0.5,
                                    "layer_s": 1e-4, "step_s": 1e-3, "collective_s": 1e-5, "request_s": 2e-3,
                                    "request_tp_s": 1e-3}


def test_gptfast_llama2_7b_by_hand():
    """Llama-2-7B bf16 on one A100 80GB (2039 GB/s), batch 1, cache of 105 tokens (prompt 5 + 200 / 2):
    weights 32 x (4 x 4096^2 + 3 x 4096 x 11008) + 32000 x 4096 LM head = 6,607,077,376 x 2 B, at 0.5 x 2039 GB/s
    -> 12.961 ms; K and V 105 x 32 layers x 2 x 4096 x 2 B = 55,050,240 B at 0.25 x 2039 GB/s (group 1)
    -> 0.108 ms; fixed 32 layers x 100 us + 1 ms per step = 4.2 ms. 17.269 ms -> 57.91 tok/s."""
    weights = (32 * (4 * 4096 ** 2 + 3 * 4096 * 11008) + 32000 * 4096) * 2
    kv = 105 * 32 * 2 * 4096 * 2
    tpot = weights / (2039e9 * 0.5) + kv / (2039e9 * 0.25) + 32 * 1e-4 + 1e-3
    assert tpot == pytest.approx(17.269e-3, rel=1e-4)
    r = predict_row(ROWS[GPTFAST], "expected", GIVEN)
    assert r["mode"] == "expected" and r["predicted"] == pytest.approx(1 / tpot, rel=2e-3)  # activations: < 0.2 %


def test_a_tensor_parallel_prefill_pays_the_request_cost_per_extra_gpu():
    """TTFT of Llama-2-70B on 4 GPUs (128-token prompt): request_s + request_tp_s x 3 on top of the step, so
    5 ms more of request_tp_s adds 15 ms; on one GPU (Llama-2-7B) it adds nothing."""
    def ttft(row_id, extra):
        return predict_row(ROWS[row_id], "expected", GIVEN | {"request_tp_s": extra})["predicted"]

    tp4, tp1 = "trtllm-h100-sxm-llama2-70b-tp4-ttft-128", "trtllm-h100-sxm-llama2-7b-ttft-128"
    assert ROWS[tp4]["tp"] == 4 and ROWS[tp1]["tp"] == 1 and ROWS[tp4]["metric"] == "ttft_s"
    assert ttft(tp4, 6e-3) - ttft(tp4, 1e-3) == pytest.approx(3 * 5e-3, rel=1e-9)
    assert ttft(tp1, 6e-3) == ttft(tp1, 1e-3)
    # `kvwall speed` / `roofline` time the prefill phase with the same term
    from kvwall.predict.memory import Parallel
    from kvwall.predict.roofline import prefill

    spec = load_spec("llama-2-70b")
    fm = Formats.for_spec(spec)
    roofs = [expected_roof(get_device("h100-sxm"), "bf16", fm, spec, 4, GIVEN | {"request_tp_s": x})
             for x in (1e-3, 6e-3)]
    times = [prefill(spec, 128, 1, fm, r, Parallel(4)).time_s for r in roofs]
    assert times[1] - times[0] == pytest.approx(3 * 5e-3, rel=1e-9)


def test_a_vllm_v0_row_pays_its_host_cost_per_sequence_per_step():
    """The OCI MI300X batch-256 row (host_cost vllm-v0): 0.2 ms more of vllm_v0_row_s adds 256 x 0.2 = 51.2 ms to
    its TPOT; a row without host_cost (TensorRT-LLM at batch 1024) pays nothing, nor does any kvwall prediction."""
    def tpot(row_id, extra):
        return predict_row(ROWS[row_id], "expected", GIVEN | {"vllm_v0_row_s": extra})["tpot_s"]

    v0, trt = "vllm-mi300x-llama3.1-405b-fp8-tp8-b256", "trtllm-h100-sxm-llama2-70b-tp2-b1024-128-128"
    assert ROWS[v0]["host_cost"] == "vllm-v0" and ROWS[v0]["batch"] == 256 and "host_cost" not in ROWS[trt]
    assert tpot(v0, 0.3e-3) - tpot(v0, 0.1e-3) == pytest.approx(256 * 0.2e-3, rel=1e-9)
    assert tpot(trt, 0.3e-3) == tpot(trt, 0.1e-3)
    spec = load_spec("llama-3.1-405b")
    fm = Formats.for_spec(spec, "fp8")
    assert expected_roof(get_device("mi300x"), "fp8", fm, spec, 8, GIVEN).device.runner_time(256) == 0.0


def test_grouped_ops_time_like_the_roofline():
    """The fit's evaluator (ops grouped once per row) gives exactly what decode() gives on the same roof."""
    row = ROWS["gptfast-a100-llama3.1-70b-bf16-tp4"]
    p = prepare(row)
    roof = expected_roof(p.device, p.dtype, p.fm, p.spec, row["tp"], GIVEN)
    from kvwall.predict.memory import Parallel

    want = decode(p.spec, p.context, row["batch"], p.fm, roof, Parallel(row["tp"])).time_s
    assert figures(p, roof)["tpot_s"] == pytest.approx(want, rel=1e-9)


def test_classes_and_attention_whatever_the_group():
    """Device classes from vendor and memory; attention streams the cache at bw_cache x the class factor for any
    group (issue #43's form, chosen leave-one-source-out): Llama-2-70B (group 8) and Llama-2-7B (group 1) on an
    A100 both read it at 0.25 x 2039 GB/s under GIVEN."""
    assert [device_class(get_device(d)) for d in ("a100-80gb", "l40s", "mi300x", "apple-m2-ultra", "rtx-4090",
                                                  "dgx-spark")] == ["hbm", "gddr", "amd", "unified", "gddr", "gddr"]
    for name in ("llama-2-70b", "llama-2-7b"):
        spec = load_spec(name)
        roof = expected_roof(get_device("a100-80gb"), "bf16", Formats.for_spec(spec), spec, 1, GIVEN)
        assert roof.device.op_bandwidth["attention"] == pytest.approx(0.25 * 2039e9)


def _synthetic(ids, params, scale=None):
    """Catalog rows whose measured value is what expected mode predicts under `params` (x scale[id])."""
    out = []
    for i in ids:
        row = dict(ROWS[i])
        row["value"] = predict_row(row, "expected", params)["predicted"]
        if scale and i in scale:
            row["value"] *= scale[i] if row["metric"] not in ("tpot_s", "ttft_s") else 1 / scale[i]
        out.append(row)
    return out


TINY = ["gptfast-a100-llama2-7b-bf16", "gptfast-a100-llama2-7b-bf16-tp2", "gptfast-a100-llama2-7b-bf16-tp8",
        "gptfast-a100-llama2-7b-int8", "gptfast-a100-llama3.1-8b-bf16", "gptfast-a100-llama3.1-8b-bf16-tp4",
        "gptfast-a100-llama2-70b-bf16-tp4", "gptfast-a100-llama2-70b-int8", "gptfast-a100-llama3.1-70b-bf16-tp8"]


@pytest.mark.slow
def test_leave_one_out_on_a_table_the_model_can_reproduce():
    """Values made by the model itself: every left-out row is predicted back (errors ~0)."""
    truth = {k: v[1] for k, v in PARAMS.items()} | {"bw_weights": 0.6, "layer_s": 4e-5, "collective_s": 8e-6,
                                                     "int_weights": 0.8}
    preps = [prepare(r) for r in _synthetic(TINY, truth)]
    full = fit(preps)
    assert max(abs(e) for e in leave_one_out(preps, full)) < 0.01


@pytest.mark.slow
def test_leave_one_out_does_not_see_the_row():
    """One row published 2x faster than the rest imply: leave-one-out predicts it at half its value (-50 %),
    while a fit that sees it bends toward it."""
    truth = {k: v[1] for k, v in PARAMS.items()} | {"bw_weights": 0.6, "layer_s": 4e-5}
    rows = _synthetic(TINY, truth, scale={"gptfast-a100-llama2-7b-int8": 2.0})
    preps = [prepare(r) for r in rows]
    full = fit(preps)
    odd = TINY.index("gptfast-a100-llama2-7b-int8")
    loo = leave_one_out(preps, full, only=[odd])[0]
    seen = figures(preps[odd], expected_roof(preps[odd].device, "bf16", preps[odd].fm, preps[odd].spec, 1, full))
    assert loo == pytest.approx(-0.5, abs=0.02)
    assert abs(seen["error"]) < abs(loo)


ROOT = Path(__file__).parents[2]
# a row of the leave-one-out table the docs print: "| gpt-fast (29) | 4.9 % | 39 % |", or the first, with the ideal
# figures beside: "| all (70) | **5.5 %** (ideal: 87 %) | 145 % (ideal: 320 %) |"
_TABLE_ROW = re.compile(r"^\| (?P<rows>[^|(]+?) \((?P<n>\d+)\) "
                        r"\| \**(?P<median>[\d.]+) %\**(?: \(ideal: (?P<ideal_median>[\d.]+) %\))? "
                        r"\| (?P<max>[\d.]+) %(?: \(ideal: (?P<ideal_max>[\d.]+) %\))? \|$")
# the README's one-line summary of it: "... with a median error of 5.5 %, scored leave-one-out; the ideal bound is
# 87 % fast"
_SUMMARY = re.compile(r"median error of (?P<median>[\d.]+) %,\s+scored\s+leave-one-out;\s+the ideal bound is\s+"
                      r"(?P<ideal_median>[\d.]+) %")


def docs_table() -> dict[str, dict[str, str]]:
    """The leave-one-out table README.md or docs/**/*.md print (the one with an "all (N)" row), by row name."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        rows = {}
        for line in doc.read_text(encoding="utf-8").splitlines():
            m = _TABLE_ROW.match(line.strip())
            if m:
                rows[m["rows"]] = m.groupdict()
            elif "all" in rows:
                return rows
            else:
                rows = {}
        if "all" in rows:
            return rows
    return {}


# a row of the docs' table of both scores: "| context ≥ 16k | 7 | 3.2 % | **10.1 %** |" (issue #43)
_BOTH_ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<n>\d+) \| (?P<loo>[\d.]+) % \| \**(?P<loso>[\d.]+) %\** \|$")


def docs_both_scores() -> dict[str, dict[str, str]]:
    """docs/validation.md's table of leave-one-out beside leave-one-source-out, by group name as the summaries
    key it ("all", an engine, or a band: "context ≥ 16k" -> ">= 16k")."""
    rows = {}
    for line in (ROOT / "docs" / "validation.md").read_text(encoding="utf-8").splitlines():
        m = _BOTH_ROW.match(line.strip())
        if m:
            name = m["name"].removeprefix("context ").replace("–", "-").replace("≥ ", ">= ")
            rows[name] = m.groupdict()
    return rows


def _as_printed(value: float, printed: str) -> bool:
    """`value` (a fraction) rounds to `printed` (a percentage with as many decimals as it shows)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value * 100 - float(printed)) <= 0.5 * 10 ** -decimals + 1e-9


@pytest.mark.slow
def test_stored_fit_meets_the_target_leave_one_out():
    """The issue's target on the shipped table: median |error| <= 15 % leave-one-out; every row over 35 % carries
    its explanation; the stored fit is of this table. And the leave-one-out table the docs print is what the code
    gives: every figure in it (all rows and per engine: count, median and max |error|, expected and ideal) equals
    the code's to the digits printed (5.5 % holds 5.45 .. 5.55 %), and so does the README's summary line where it
    has one, so that neither can drift from the code."""
    data = validate(catalog.measurements())
    assert data["fit"]["stale"] is False and data["mode"] == "expected"
    errors = [r["expected"]["error"] for r in data["rows"] if "error" in r]
    assert len(errors) == 152 and statistics.median(abs(e) for e in errors) <= 0.15  # 157 rows, 5 with no batch
    for r in data["rows"]:
        if "error" in r and abs(r["expected"]["error"]) > OUTLIER:
            assert ROWS[r["id"]].get("outlier") or ROWS[r["id"]].get("exclude_from_fit"), r["id"]
    assert data["summaries"]["ideal"]["all"]["median_abs_error"] > 0.5  # the ideal bound is far off, as before
    printed = docs_table()
    assert set(printed) == {"all", "gpt-fast", "TensorRT-LLM", "llama.cpp", "vLLM"}, printed
    for name, p in printed.items():
        got = {m: data["summaries"][m]["all" if name == "all" else "engines"] for m in ("expected", "ideal")}
        exp, ideal = (got[m] if name == "all" else got[m][name] for m in ("expected", "ideal"))
        assert exp["n"] == int(p["n"]), (name, exp["n"], p["n"])
        assert _as_printed(exp["median_abs_error"], p["median"]), (name, exp["median_abs_error"], p["median"])
        assert _as_printed(exp["max_abs_error"], p["max"]), (name, exp["max_abs_error"], p["max"])
        for key, printed_ideal in (("median_abs_error", p["ideal_median"]), ("max_abs_error", p["ideal_max"])):
            if printed_ideal is not None:
                assert _as_printed(ideal[key], printed_ideal), (name, key, ideal[key], printed_ideal)
    both = docs_both_scores()
    assert set(both) == {"all", "< 4k", "4k-16k", ">= 16k", "gpt-fast", "TensorRT-LLM", "llama.cpp", "vLLM"}, both
    for name, p in both.items():
        for score, key in (("expected", "loo"), ("expected_loso", "loso")):
            s = data["summaries"][score]
            st = s["all"] if name == "all" else (s["bands"] | s["engines"])[name]
            assert st["n"] == int(p["n"]) and _as_printed(st["median_abs_error"], p[key]), (name, score, st)
    for m in _SUMMARY.finditer(" ".join((ROOT / "README.md").read_text(encoding="utf-8").split())):
        assert _as_printed(data["summaries"]["expected"]["all"]["median_abs_error"], m["median"]), m[0]
        assert _as_printed(data["summaries"]["ideal"]["all"]["median_abs_error"], m["ideal_median"]), m[0]


def test_local_profile_keeps_its_calibration():
    dev = replace(get_device("a100-80gb"), name="local", op_bandwidth={"matmul": 1e12, "attention": 5e11},
                  layer_overhead_s=3e-5)
    spec = load_spec("llama-2-7b")
    fm = Formats.for_spec(spec)
    assert expected_roof(dev, "bf16", fm, spec, params=GIVEN).mode == "expected"
    assert decode(spec, 4096, 1, fm, expected_roof(dev, "bf16", fm, spec)).time_s == \
        decode(spec, 4096, 1, fm, Roof(dev)).time_s


def test_ideal_flag_gives_the_ideal_roofline(capsys):
    argv = ["roofline", "llama-2-7b", "--device", "a100-80gb", "--context", "4k", "--json"]
    assert main([*argv, "--ideal"]) == 0
    ideal = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    expected = json.loads(capsys.readouterr().out)
    spec = load_spec("llama-2-7b")
    want = decode(spec, 4096, 1, Formats.for_spec(spec), Roof(get_device("a100-80gb"))).time_s
    assert ideal["mode"] == "ideal" and ideal["phases"][0]["tpot_s"] == pytest.approx(want, rel=1e-12)
    assert expected["mode"] == "expected" and expected["phases"][0]["tpot_s"] > want


def test_ideal_knobs_need_ideal(capsys):
    assert main(["roofline", "gpt2", "--mem-eff", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwall: error: --mem-eff") and "--ideal" in err and err.count("\n") == 1


def test_fit_warning(capsys):
    """Llama-2-7B fp16 at batch 64 x 4096: K and V 64 x 4096 x 32 layers x 2 x 4096 x 2 B = 137.4 GB of cache,
    over an A100 80GB's 72 GB after the 10 % reserve; at batch 1 (2.1 GB + 13.5 GB of weights) it fits."""
    assert 64 * 4096 * 32 * 2 * 4096 * 2 == 137_438_953_472
    argv = ["roofline", "llama-2-7b", "--device", "a100-80gb", "--batch", "1,64", "--context", "4k"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and [p["fits"] for p in data["phases"]] == [True, False]
    assert "does not fit" in data["phases"][1]["fit_reason"] and data["phases"][0]["fit_reason"] is None
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "warning: batch 64 x context 4,096 does not fit" in out.replace("\n", " ")


def test_stored_parameters_are_complete_and_dated():
    data = catalog.efficiency()
    assert set(fitted()) == set(PARAMS) and data["date"] and data["table_version"] == catalog.measurements_version()
