"""Leave-one-source-out beside leave-one-out (kvwall validate, issue #43): which rows each fit sees, by hand on a
one-figure "fit"; the real fit on twin rows of two sources; context bands; the CLI and --json carrying both."""

import json
import math
from types import SimpleNamespace

import pytest

from kvwall import catalog
from kvwall.cli import main
from kvwall.predict import expected_fit
from kvwall.predict.expected import PARAMS
from kvwall.predict.expected_fit import fit, leave_one_out, leave_one_source_out, source_of
from kvwall.predict.table import prepare
from kvwall.predict.validate import band_of, predict_row, summarize


def _row(i: int, source: str, value: float) -> SimpleNamespace:
    """A stand-in for a Prepared row: only what the scoring reads (its row's value, source, fit flag)."""
    return SimpleNamespace(row={"id": f"r{i}", "value": value, "source": {"title": source}})


@pytest.fixture
def geometric_mean_fit(monkeypatch):
    """Replace the fit by one figure, the geometric mean of the values it is fitted to, and a row's log error by
    log(figure / value): the scoring's plumbing (which rows each fit sees) then has answers by hand."""
    monkeypatch.setattr(expected_fit, "fit", lambda preps, start=None: {
        "scale": math.exp(sum(math.log(p.row["value"]) for p in preps) / len(preps))})
    monkeypatch.setattr(expected_fit, "log_errors", lambda preps, params: [
        math.log(params["scale"]) - math.log(p.row["value"]) for p in preps])


def test_the_two_scores_by_hand(geometric_mean_fit):
    """Source A publishes 1, 1, 1; source B publishes 4, 4 (B's harness is 4x faster, say).
    Leave-one-out, a B row sees 1, 1, 1, 4: mean 4^(1/4) = sqrt(2), error sqrt(2) / 4 - 1 = -64.6 %; an A row sees
    1, 1, 4, 4: 2, error +100 %. Leave-one-source-out, a B row sees only A: 1, error 1/4 - 1 = -75 %; an A row sees
    only B: 4, error +300 %. The twin in its own source flatters leave-one-out: medians 100 % against 300 %."""
    preps = [_row(0, "A", 1.0), _row(1, "A", 1.0), _row(2, "A", 1.0), _row(3, "B", 4.0), _row(4, "B", 4.0)]
    loo = leave_one_out(preps, full={"scale": 0.0})
    loso = leave_one_source_out(preps)
    assert loo == pytest.approx([1.0, 1.0, 1.0, math.sqrt(2) / 4 - 1, math.sqrt(2) / 4 - 1])
    assert loso == pytest.approx([3.0, 3.0, 3.0, -0.75, -0.75])
    assert leave_one_source_out(preps, only=[4, 0]) == pytest.approx([-0.75, 3.0])  # `only`: those rows, that order
    results = [{"id": f"r{i}", "engine": "e", "device": "d", "source": "AB"[i >= 3], "error": e}
               for i, e in enumerate(loso)]
    s = summarize(results)
    assert s["all"]["median_abs_error"] == pytest.approx(3.0)
    assert s["sources"]["B"]["median_abs_error"] == pytest.approx(0.75) and s["sources"]["A"]["n"] == 3


def test_a_row_left_out_of_the_fit_is_still_held_out_with_its_source(geometric_mean_fit):
    """Leave-one-out scores a row with exclude_from_fit by the full fit (which never saw it); leave-one-source-out
    refits without its source all the same: A = 1, 1 and an excluded A row of 9, B = 4: the excluded row gets
    4 / 9 - 1 = -55.6 % (the fit without A), not the full fit's figure."""
    preps = [_row(0, "A", 1.0), _row(1, "A", 1.0), _row(2, "A", 9.0), _row(3, "B", 4.0)]
    preps[2].row["exclude_from_fit"] = "why"
    assert leave_one_source_out(preps, only=[2]) == pytest.approx([4 / 9 - 1])
    assert leave_one_out(preps, full={"scale": 3.0}, only=[2]) == pytest.approx([3 / 9 - 1])


def test_source_is_the_document():
    rows = catalog.measurements()
    assert len({source_of(r) for r in rows}) >= 12  # 9 documents before issue #43, 3 added with it
    # 3 models x 5 depths, then gpt-oss-20b and -120b x 5 depths once the gpt_oss predictor was merged
    assert sum(source_of(r) == "ggml-org/llama.cpp benches/dgx-spark.md" for r in rows) == 25


@pytest.mark.parametrize("context,band", [(1, "< 4k"), (4095, "< 4k"), (4096, "4k-16k"), (16383, "4k-16k"),
                                          (16384, ">= 16k"), (131072, ">= 16k")])
def test_bands(context, band):
    assert band_of(context) == band


def test_long_rows_land_in_the_long_band():
    """A llama-bench row at depth 16,384 decodes 32 tokens after it: context 16,384 + 32 / 2 = 16,400 (>= 16k);
    at depth 4,096: 4,112 (4k-16k); gpt-fast's 5 + 200 / 2 = 105 (< 4k)."""
    rows = {r["id"]: r for r in catalog.measurements()}
    for rid, ctx, band in (("llamacpp-dgxspark-qwen2.5-7b-q8_0-d16384", 16400, ">= 16k"),
                           ("llamacpp-dgxspark-qwen2.5-7b-q8_0-d4096", 4112, "4k-16k"),
                           ("gptfast-a100-llama2-7b-bf16", 105, "< 4k")):
        r = predict_row(rows[rid])
        assert (r["decode_context"], r["context_band"]) == (ctx, band)
    long = [r for r in rows.values() if band_of(r["prompt_tokens"] + r["output_tokens"] // 2) == ">= 16k"]
    assert len(long) >= 11 and len({r["source"]["title"] for r in long}) >= 2


# gpt-fast rows of one document: bf16, int8, tp 1 to 8, 7B to 70B (what the fit needs to pin its figures)
TINY = ["gptfast-a100-llama2-7b-bf16", "gptfast-a100-llama2-7b-bf16-tp2", "gptfast-a100-llama2-7b-bf16-tp8",
        "gptfast-a100-llama2-7b-int8", "gptfast-a100-llama3.1-8b-bf16", "gptfast-a100-llama3.1-8b-bf16-tp4",
        "gptfast-a100-llama2-70b-bf16-tp4", "gptfast-a100-llama2-70b-int8", "gptfast-a100-llama3.1-70b-bf16-tp8"]


def test_real_fit_on_twin_rows_of_two_sources():
    """The real fit: source A is nine gpt-fast rows whose values are what expected mode predicts under given
    figures; source B re-publishes two of them 2x faster. Leave-one-source-out fits A alone, reproduces it, and
    predicts each B row at half its value: -50 % (by hand); leave-one-out sees the other B twin and the A twin and
    lands in between."""
    truth = {k: v[1] for k, v in PARAMS.items()} | {"bw_weights": 0.6, "layer_s": 4e-5}
    rows = {r["id"]: r for r in catalog.measurements()}
    a = [dict(rows[i], value=predict_row(rows[i], "expected", truth)["predicted"]) for i in TINY]
    b = [dict(r, id=r["id"] + "-b", value=r["value"] * 2, source={"title": "B"}) for r in a[:2]]
    assert all(r["metric"] == "decode_tok_s_per_seq" for r in b)  # a rate: 2x faster = 2x the value
    preps = [prepare(r) for r in a + b]
    twins = [len(a), len(a) + 1]
    loso = leave_one_source_out(preps, only=twins)
    loo = leave_one_out(preps, fit(preps), only=twins)
    assert loso == pytest.approx([-0.5, -0.5], abs=0.01)
    assert all(-0.45 < e < 0 for e in loo), loo


@pytest.mark.slow
def test_cli_prints_both_medians_and_json_carries_them(capsys):
    """One device's rows (the scoring still fits the whole table): the tables and the medians line name both
    scores, and --json has each row's leave-one-source-out error and the summaries by band and source."""
    assert main(["validate", "--device", "dgx-spark", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["summaries"]) == {"expected", "expected_loso", "ideal"}
    loso = data["summaries"]["expected_loso"]
    assert loso["checked"] == 25 and set(loso["bands"]) == {"< 4k", "4k-16k", ">= 16k"}
    assert loso["bands"][">= 16k"]["n"] == 10 and list(loso["sources"]) == ["ggml-org/llama.cpp benches/dgx-spark.md"]
    row = data["rows"][0]
    assert {"error", "loso_error", "in_fit"} <= set(row["expected"]) and row["source"] and row["context_band"]
    assert main(["validate", "--device", "dgx-spark"]) == 0
    text = capsys.readouterr().out
    assert "leave-one-source-out" in text and "context >= 16k" in text
    assert "median |error|: leave-one-row-out" in text
