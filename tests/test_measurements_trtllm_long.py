"""Issue #43: long rows from a third publisher. NVIDIA's TensorRT-LLM tech blog 16 (Skip Softmax Attention) times
Qwen3-30B-A3B-Instruct-2507 in BF16 at batch 1 (concurrency 1, max_batch_size 1) after LongBench V2 prompts of
130k tokens on average, on one H200 and one B200; its target-sparsity-0.0 row is the dense baseline."""

import pytest

from kvwall.catalog import measurements
from kvwall.predict.memory import cache_bytes_per_token
from kvwall.predict.validate import band_of
from kvwall.spec.formats import get_format
from kvwall.spec.resolve import load_spec

ROWS = {r["id"]: r for r in measurements()}
TITLE = "TensorRT-LLM tech blog 16: Accelerating Long-Context Inference with Skip Softmax Attention"
# The blog's table "LongBench V2, avg ISL=130k, OSL=200", row Target Sparsity 0.0, copied by hand (ms).
PUBLISHED_MS = {("h200", "ttft"): 16486.70, ("h200", "tpot"): 9.34, ("b200", "ttft"): 6990.59, ("b200", "tpot"): 6.30}


def _row(device: str, kind: str) -> dict:
    return ROWS[f"trtllm-skipsoftmax-{device}-qwen3-30b-a3b-bf16-isl130k-{kind}"]


@pytest.mark.parametrize(("device", "kind"), list(PUBLISHED_MS))
def test_rows_copy_the_blog_table(device, kind):
    r = _row(device, kind)
    assert r["value"] == pytest.approx(PUBLISHED_MS[device, kind] / 1000, rel=1e-12)  # seconds
    assert r["metric"] == f"{kind}_s" and r["source"]["title"] == TITLE
    assert (r["model"], r["weight_format"], r["kv_format"]) == ("qwen3-30b-a3b", "bf16", "bf16")
    assert (r["batch"], r["n_devices"], r["tp"], r["prompt_tokens"], r["output_tokens"]) == (1, 1, 1, 130_000, 200)


def test_a_third_publisher_at_16k_and_more():
    """Before these rows every scored row at >= 16k tokens came from ggml-org/llama.cpp or the Qwen docs (35 rows);
    the blog adds 4, from NVIDIA."""
    long = [
        r
        for r in ROWS.values()
        if r["batch"] is not None and band_of(r["prompt_tokens"] + r["output_tokens"] // 2) == ">= 16k"
    ]
    others = [r for r in long if not r["source"]["title"].startswith(("ggml-org/llama.cpp", "Qwen"))]
    assert len(long) == 39 and {r["source"]["title"] for r in others} == {TITLE} and len(others) == 4


def test_cache_a_decode_step_reads():
    """Qwen3-30B-A3B keeps K and V for 48 layers x 4 KV heads x 128 in bf16: 2 x 48 x 4 x 128 x 2 B = 98,304 B a
    token; at the rows' decode context, 130,000 + 200 / 2 = 130,100 tokens, 12,789,350,400 B, which at the
    datasheet 4.8 TB/s (H200) alone takes 2.66 ms of the measured 9.34 ms."""
    assert cache_bytes_per_token(load_spec("qwen3-30b-a3b"), get_format("bf16")) == 2 * 48 * 4 * 128 * 2 == 98_304
    assert 98_304 * 130_100 == 12_789_350_400
    assert 12_789_350_400 / 4.8e12 == pytest.approx(2.66e-3, rel=2e-3) and 2.66e-3 < PUBLISHED_MS["h200", "tpot"] / 1e3


def test_only_the_tpot_rows_are_fitted():
    """The TTFT is a mean over prompts of different lengths (prefill attention grows with the square of the length):
    scored, not fitted, and its miss explained; the TPOT (linear in the context) is fitted."""
    for device in ("h200", "b200"):
        assert _row(device, "ttft").get("exclude_from_fit") and _row(device, "ttft").get("outlier")
        assert not _row(device, "tpot").get("exclude_from_fit")
