"""The published-measurements table: it loads, every row resolves and says where it is from."""

import math
import re

import pytest

from kvwall.catalog import find_model, measurements
from kvwall.predict.devices import get_device
from kvwall.predict.expected import HOST_COSTS
from kvwall.spec.formats import get_format

METRICS = {"decode_tok_s_per_seq", "tpot_s", "ttft_s", "throughput_tok_s"}
KEYS = {"id", "model", "device", "power_cap_W", "n_devices", "tp", "engine", "engine_version", "weight_format",
        "kv_format", "batch", "prompt_tokens", "output_tokens", "metric", "value", "source", "unconfirmed", "notes"}
ROWS = measurements()


def test_table_size_and_spread():
    assert len(ROWS) >= 30
    assert len({r["device"] for r in ROWS}) >= 4
    assert len({r["engine"] for r in ROWS}) >= 3
    assert len({r["id"] for r in ROWS}) == len(ROWS)  # ids are unique


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["id"])
def test_row_resolves(row):
    assert KEYS <= set(row)
    assert find_model(row["model"]) == row["model"]
    get_device(row["device"])  # raises on an unknown device
    get_format(row["weight_format"], head_ok=True)  # a weight format may name /HEAD (mxfp4:experts/q8_0)
    get_format(row["kv_format"])
    assert row["metric"] in METRICS


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["id"])
def test_row_values_are_sane(row):
    v = row["value"]
    assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0
    if row["metric"] in ("ttft_s", "tpot_s"):
        assert v < 60  # seconds, not milliseconds
    assert row["batch"] is None or (isinstance(row["batch"], int) and row["batch"] >= 1)
    assert row["prompt_tokens"] >= 0 and row["output_tokens"] >= 1
    assert row["tp"] >= 1 and row["n_devices"] >= row["tp"]
    assert row["power_cap_W"] is None or row["power_cap_W"] > 0
    assert row.get("host_cost") in (None, *HOST_COSTS)  # an engine host cost expected mode fits


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["id"])
def test_row_has_a_source(row):
    src = row["source"]
    assert src["title"].strip() and re.match(r"https://\S+$", src["url"])
    assert src["where"].strip() and re.match(r"\d{4}", src["date"])
    assert isinstance(row["unconfirmed"], list)


def _row(id_):
    return next(r for r in ROWS if r["id"] == id_)


def test_readme_figures_copied():
    # The two gpt-fast figures the README quotes (A100-80GB at 330 W, batch 1, 5-token prompt).
    for id_, v in [("gptfast-a100-llama2-7b-bf16", 104.9), ("gptfast-a100-llama3-8b-bf16", 94.25)]:
        r = _row(id_)
        assert (r["value"], r["power_cap_W"], r["batch"], r["prompt_tokens"]) == (v, 330, 1, 5)


def test_oracle_rows_agree_with_their_latency_column():
    # The blog prints both output tok/s and average latency (s): tok/s should be batch * 128 / latency.
    latency = {1: 3.530, 8: 3.974, 32: 5.130, 256: 17.750}
    for b, lat in latency.items():
        r = _row(f"vllm-mi300x-llama3.1-405b-fp8-tp8-b{b}")
        assert r["value"] == pytest.approx(b * 128 / lat, rel=0.02)


def test_derived_amd_rows():
    # AMD publishes end-to-end latency (17.236 s at batch 1, 18.057 s at batch 2) for 2048 output tokens.
    assert _row("vllm-mi300x-llama3.1-70b-fp8-tp8-b1-latency")["value"] == pytest.approx(2048 / 17.236, rel=1e-3)
    assert _row("vllm-mi300x-llama3.1-70b-fp8-tp8-b2-latency")["value"] == pytest.approx(4096 / 18.057, rel=1e-3)
