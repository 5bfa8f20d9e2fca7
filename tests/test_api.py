"""kvwall.api: the predictor's Python face. Figures checked against hand calculations from public configs, every
result's to_dict() against the CLI's --json for the same arguments, and the CLI shown to go through the API.

Hand figures used below (public config.json values):
- Llama-3-8B: 8,030,261,248 parameters (16,060,522,496 B in bf16); KV per token 2 (K, V) x 32 layers x 8 KV heads
  x 128 dims x 2 B = 131,072 B; embedding table 128,256 x 4,096 x 2 B = 1,050,673,152 B.
- Llama-3-70B: KV per token 2 x 80 x 8 x 128 x 2 B = 327,680 B; 70,553,706,496 parameters (141.1 GB in bf16).
- DeepSeek-V3 (MLA): (512 latent + 64 rope) x 61 layers x 2 B = 70,272 B per token.
- H100 SXM: 80 GB (80e9 B), 3.35 TB/s; 10 % of memory kept in reserve.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

import kvwall
from kvwall import api
from kvwall.cli import main
from kvwall.errors import KvwallError

LLAMA8_WEIGHTS = 2 * 8_030_261_248  # bf16
LLAMA8_KV = 2 * 32 * 8 * 128 * 2  # 131,072 B per token
LLAMA70_KV = 2 * 80 * 8 * 128 * 2  # 327,680 B per token
DSV3_KV = (512 + 64) * 61 * 2  # 70,272 B per token
H100 = 80 * 10**9
RESERVE = H100 // 10


def cli_json(capsys, *argv) -> dict:
    """The CLI run in-process with --json, its stdout parsed."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# -- to_dict() is the CLI's --json -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, call", [
    (["memory", "llama-3-8b"], lambda: api.memory("llama-3-8b")),
    (["memory", "llama-3-70b", "--context", "128k", "--batch", "8", "--kv-format", "fp8", "--tp", "4", "--device",
      "h100-sxm"],
     lambda: api.memory("llama-3-70b", context="128k", batch=8, kv_format="fp8", tp=4, device="h100-sxm")),
    (["memory", "jamba-v0.1", "--block-size", "16", "--pp", "2", "--context", "100000", "--batch", "3"],
     lambda: api.memory("jamba-v0.1", block_size=16, pp=2, context=100_000, batch=3)),
    (["memory", "llama-3-8b", "--kv-heads", "2", "--window", "1k", "--context", "8k"],
     lambda: api.memory("llama-3-8b", kv_heads=2, window="1k", context="8k")),
    (["memory", "deepseek-v3", "--ep", "8", "--batch", "64", "--weight-format", "fp8", "--device", "h200"],
     lambda: api.memory("deepseek-v3", ep=8, batch=64, weight_format="fp8", device="h200")),
])
def test_memory_to_dict_is_the_cli_json(capsys, argv, call):
    assert call().to_dict() == cli_json(capsys, *argv)


@pytest.mark.parametrize("argv, call", [
    (["fit", "llama-3-8b", "--memory", "80GB", "--batch", "8"], lambda: api.fit("llama-3-8b", memory="80GB", batch=8)),
    (["fit", "llama-3-70b", "--context", "32k"], lambda: api.fit("llama-3-70b", context="32k")),
    (["fit", "mamba-2.8b-hf", "--device", "a100-80gb"], lambda: api.fit("mamba-2.8b-hf", device="a100-80gb")),
    (["fit", "llama-3-70b", "--reserve", "5GB", "--block-size", "16", "--tp", "2", "--kv-format", "fp8"],
     lambda: api.fit("llama-3-70b", reserve="5GB", block_size=16, tp=2, kv_format="fp8")),
])
def test_fit_to_dict_is_the_cli_json(capsys, argv, call):
    assert call().to_dict() == cli_json(capsys, *argv)


@pytest.mark.slow
@pytest.mark.parametrize("argv, call", [
    (["compare"], lambda: api.compare()),
    (["compare", "llama-3-8b", "deepseek-v3", "--context", "8k,1M", "--memory", "24GiB", "--kv-format", "fp8"],
     lambda: api.compare(["llama-3-8b", "deepseek-v3"], context=["8k", "1M"], memory="24GiB", kv_format="fp8")),
    (["compare", "llama-3-8b", "--batch", "4", "--device", "h200", "--window", "4k", "--context", "128k"],
     lambda: api.compare("llama-3-8b", batch=4, device="h200", window=4096, context=131_072)),
])
def test_compare_to_dict_is_the_cli_json(capsys, argv, call):
    assert call().to_dict() == cli_json(capsys, *argv)


@pytest.mark.slow
@pytest.mark.parametrize("argv, call", [
    (["roofline", "llama-3-8b"], lambda: api.roofline("llama-3-8b")),
    (["roofline", "llama-3-70b", "--batch", "1,8,64", "--tp", "4", "--ideal"],
     lambda: api.roofline("llama-3-70b", batch=[1, 8, 64], tp=4, ideal=True)),
    (["roofline", "deepseek-v3", "--mla", "naive", "--tp", "8", "--weight-format", "fp8"],
     lambda: api.roofline("deepseek-v3", mla="naive", tp=8, weight_format="fp8")),
    (["roofline", "llama-3-70b", "--pp", "4", "--batch", "8", "--micro-batches", "4", "--prompt", "8k"],
     lambda: api.roofline("llama-3-70b", pp=4, batch=8, micro_batches=4, prompt_tokens="8k")),
    (["roofline", "llama-3-8b", "--ideal", "--compute-eff", "0.7", "--mem-eff", "0.8", "--link-latency", "3",
      "--compute-dtype", "fp8", "--device", "h200"],
     lambda: api.roofline("llama-3-8b", ideal=True, compute_eff=0.7, mem_eff=0.8, link_latency=3,
                          compute_dtype="fp8", device="h200")),
])
def test_roofline_to_dict_is_the_cli_json(capsys, argv, call):
    assert call().to_dict() == cli_json(capsys, *argv)


@pytest.mark.slow
@pytest.mark.parametrize("argv, call", [
    (["speed", "llama-3-8b", "llama-3-70b"], lambda: api.speed(["llama-3-8b", "llama-3-70b"])),
    (["speed", "llama-3-8b", "gemma-3-27b", "--tp", "2", "--ideal", "--compute-eff", "0.8", "--context", "4k,128k",
      "--prompt", "1k", "--batch", "4"],
     lambda: api.speed(("llama-3-8b", "gemma-3-27b"), tp=2, ideal=True, compute_eff=0.8, context=[4096, "128k"],
                       prompt_tokens=1024, batch=4)),
    (["speed", "deepseek-v3", "--device", "h200", "--kv-format", "fp8"],
     lambda: api.speed("deepseek-v3", device="h200", kv_format="fp8")),
])
def test_speed_to_dict_is_the_cli_json(capsys, argv, call):
    assert call().to_dict() == cli_json(capsys, *argv)


@pytest.mark.slow
@pytest.mark.parametrize("argv, call", [
    (["simulate", "llama-3-8b", "--rate", "2", "--requests", "50"],
     lambda: api.simulate("llama-3-8b", rate=2, requests=50)),
    (["simulate", "llama-3-8b", "--sweep", "tp=1,2", "kv-format=bf16,fp8", "--concurrency", "4", "--requests", "20",
      "--prompt-tokens", "lognormal:mean=512,sd=0.5"],
     lambda: api.simulate("llama-3-8b", sweep={"tp": [1, 2], "kv-format": "bf16,fp8"}, concurrency=4, requests=20,
                          prompt_tokens="lognormal:mean=512,sd=0.5")),
    (["simulate", "llama-3-8b", "--rate", "3", "--requests", "30", "--shared-prefix", "256", "--kv-memory", "2GB",
      "--split-prefill", "--seed", "3", "--slo-ttft", "500ms"],
     lambda: api.simulate("llama-3-8b", rate=3.0, requests=30, shared_prefix=256, kv_memory="2GB",
                          split_prefill=True, seed=3, slo_ttft=0.5)),
])
def test_simulate_to_dict_is_the_cli_json(capsys, argv, call):
    assert call().to_dict() == cli_json(capsys, *argv)


@pytest.mark.slow
def test_a_plot_path_is_in_both(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "speed.png")
    r = api.speed("llama-3-8b", context="4k,32k", plot=path)
    assert (tmp_path / "speed.png").stat().st_size > 0
    assert r.to_dict() == cli_json(capsys, "speed", "llama-3-8b", "--context", "4k,32k", "--plot", path)
    assert r.to_dict()["plot"] == path


# -- memory ------------------------------------------------------------------------------------------------------

def test_memory_llama3_8b_by_hand():
    r = api.memory("llama-3-8b", context="128k", device="h100-sxm")
    assert isinstance(r, api.MemoryResult)
    assert (r.model, r.batch, r.context, r.gpus) == ("llama-3-8b", 1, 131_072, 1)
    assert r.cache_bytes_per_token == LLAMA8_KV == 131_072
    assert r.cache_bytes == 131_072 * LLAMA8_KV  # 16 GiB
    assert r.weights_bytes == LLAMA8_WEIGHTS
    assert (r.per_gpu_weights_bytes, r.per_gpu_cache_bytes) == (LLAMA8_WEIGHTS, 131_072 * LLAMA8_KV)
    assert r.per_gpu_bytes == LLAMA8_WEIGHTS + 131_072 * LLAMA8_KV
    assert r.fixed_bytes_per_sequence == 0
    # 80 GB - 8 GB reserve - 16.06 GB weights - 17.18 GB cache
    assert r.fits is True and r.free_bytes == H100 - RESERVE - LLAMA8_WEIGHTS - 17_179_869_184 == 38_759_608_320
    assert r.device == "h100-sxm"
    d = r.to_dict()
    assert (d["weight_bytes"], d["cache_bytes"], d["per_gpu"]["total_bytes"]) == \
        (r.weights_bytes, r.cache_bytes, r.per_gpu_bytes)


def test_memory_fp8_tp4_does_not_fit():
    r = api.memory("llama-3-70b", context="128k", batch=8, kv_format="fp8", tp=4, device="h100-sxm")
    assert r.cache_bytes_per_token == LLAMA70_KV // 2  # fp8: 1 byte per element
    assert r.cache_bytes == 8 * 131_072 * LLAMA70_KV // 2
    assert r.per_gpu_cache_bytes == r.cache_bytes // 4  # 8 KV heads split over 4 GPUs
    assert r.gpus == 4 and r.fits is False and r.free_bytes < 0


def test_memory_without_a_device_says_nothing_of_fitting():
    r = api.memory("deepseek-v3", context=4096)
    assert r.cache_bytes_per_token == DSV3_KV == 70_272
    assert r.cache_bytes == 4096 * DSV3_KV
    assert (r.device, r.fits, r.free_bytes) == (None, None, None)
    assert "device" not in r.to_dict()


def test_memory_what_ifs_and_a_modelspec():
    from kvwall.spec.resolve import load_spec

    mqa = api.memory("llama-3-8b", kv_heads=1)
    assert mqa.cache_bytes_per_token == 2 * 32 * 1 * 128 * 2  # 16,384 B: one KV head
    assert any("1 KV heads" in n for n in mqa.notes)
    windowed = api.memory("llama-3-8b", window="1k", context="8k")
    assert windowed.cache_bytes == 1024 * LLAMA8_KV  # every layer keeps only its last 1,024 tokens
    spec = load_spec("llama-3-70b")
    assert api.memory(spec, context=1000).cache_bytes == 1000 * LLAMA70_KV
    assert api.memory(spec, context=1000).spec is spec


def test_memory_paged_blocks_round_up():
    r = api.memory("llama-3-8b", context=1000, batch=2, block_size=16)
    assert r.cache_bytes == 2 * 1008 * LLAMA8_KV  # 1,000 tokens in 63 blocks of 16
    assert r.to_dict()["cache_waste_bytes"] == 2 * 8 * LLAMA8_KV


# -- fit ---------------------------------------------------------------------------------------------------------

def test_fit_longest_context_and_largest_batch_by_hand():
    r = api.fit("llama-3-8b", memory="80GB", batch=8)
    assert isinstance(r, api.FitResult)
    assert (r.memory_bytes, r.reserve_bytes, r.weights_bytes) == (H100, RESERVE, LLAMA8_WEIGHTS)
    assert r.available_bytes == H100 - RESERVE - LLAMA8_WEIGHTS == 55_939_477_504
    assert r.max_context == 55_939_477_504 // (8 * LLAMA8_KV) == 53_348
    assert (r.batch, r.context, r.max_batch, r.weights_fit, r.unbounded) == (8, None, None, True, False)
    assert r.device == "80 GB" and r.model_max_context == 8192
    b = api.fit("llama-3-8b", context="8k")  # the default device: an H100's 80 GB
    assert b.device == "h100-sxm (80 GB)"
    assert b.max_batch == 55_939_477_504 // (8192 * LLAMA8_KV) == 52


def test_fit_reports_weights_that_do_not_fit_and_fixed_state():
    assert api.fit("llama-3-70b").weights_fit is False  # 141.1 GB of bf16 weights, 72 GB usable
    assert api.fit("llama-3-70b", tp=2, reserve=0).weights_fit is True  # 70.6 GB on each of two
    mamba = api.fit("mamba-2.8b-hf")
    assert mamba.unbounded is True and mamba.max_context is None


# -- compare -----------------------------------------------------------------------------------------------------

def test_compare_rows_by_hand():
    r = api.compare(["llama-3-8b", "llama-3-70b", "deepseek-v3"], context="4k,128k")
    assert isinstance(r, api.CompareResult)
    assert r.contexts == (4096, 131_072) and r.memory_bytes == H100 and r.reserve_bytes == RESERVE
    by = {m.model: m for m in r.models}
    assert [m.model for m in r.models] == ["llama-3-8b", "llama-3-70b", "deepseek-v3"]
    assert by["llama-3-8b"].cache_bytes_per_token == LLAMA8_KV
    assert by["llama-3-70b"].cache_bytes_per_token == LLAMA70_KV
    assert by["deepseek-v3"].cache_bytes_per_token == DSV3_KV
    assert by["llama-3-8b"].cache_bytes == {4096: 4096 * LLAMA8_KV, 131_072: 131_072 * LLAMA8_KV}
    assert (by["llama-3-8b"].tp, by["llama-3-70b"].tp) == (1, 2)  # 141 GB of weights need two 80 GB GPUs
    assert by["llama-3-8b"].max_context == 55_939_477_504 // LLAMA8_KV
    assert r.to_dict()["models"][0]["cache_bytes"]["4096"] == 4096 * LLAMA8_KV  # JSON keys are text


def test_compare_default_lineup():
    assert len(api.compare(context=4096).models) == len(api.LINEUP) == 7


# -- roofline ----------------------------------------------------------------------------------------------------

def test_roofline_ideal_decode_is_bytes_over_bandwidth():
    r = api.roofline("llama-3-8b", batch=[1, 8], ideal=True)
    assert isinstance(r, api.RooflineResult)
    assert (r.model, r.device, r.mode, r.context, r.prompt_tokens) == ("llama-3-8b", "h100-sxm", "ideal", 4096, 2048)
    one, eight = r.points
    assert (one.batch, eight.batch) == (1, 8)
    # batch 1: every weight but the embedding table, and 4k tokens of cache, at 3.35 TB/s
    streamed = LLAMA8_WEIGHTS - 128_256 * 4096 * 2 + 4096 * LLAMA8_KV
    assert one.tpot_s == pytest.approx(streamed / 3.35e12, rel=1e-3)
    assert one.decode_bound == "memory" and one.fits
    assert one.tokens_per_s_per_seq == pytest.approx(1 / one.tpot_s)
    assert eight.tokens_per_s_total == pytest.approx(8 / eight.tpot_s)
    assert eight.tpot_s > one.tpot_s  # eight sequences' cache to read
    assert one.decode.time_s == one.tpot_s and one.prefill.time_s == one.ttft_s
    assert r.weights_fit and r.ceiling_batch == 55_939_477_504 // (4096 * LLAMA8_KV)


def test_roofline_reports_what_does_not_fit():
    r = api.roofline("llama-3-70b", context="128k", batch=64)  # 141 GB weights on one H100
    assert r.weights_fit is False and r.fits is False and r.ceiling_batch is None
    assert r.points[0].fit_reason and any("what-ifs" in n for n in r.notes)


# -- speed -------------------------------------------------------------------------------------------------------

def test_speed_places_each_point_on_the_smallest_group():
    r = api.speed(["llama-3-8b", "llama-3-70b"], context=["4k", "128k"], ideal=True)
    assert isinstance(r, api.SpeedResult)
    assert (r.device, r.mode, r.batch, r.prompt_tokens) == ("h100-sxm", "ideal", 1, 2048)
    small, big = r.models
    assert [p.context for p in small.points] == [4096, 131_072]
    assert [p.tp for p in small.points] == [1, 1]
    # 70B: 141.1 GB of weights need two GPUs at 4k; at 128k its cache is 131,072 x 327,680 B = 42.9 GB, and
    # two GPUs would hold 70.6 + 21.5 GB each (over the 72 GB usable): four hold 35.3 + 10.7 GB
    assert [p.tp for p in big.points] == [2, 4]
    assert all(p.tokens_per_s == pytest.approx(1 / p.tpot_s) for m in r.models for p in m.points)
    assert small.points[1].tpot_s > small.points[0].tpot_s  # 128k of cache to read, not 4k
    assert r.fits and small.fit_warning is None


def test_speed_at_a_given_tp_warns():
    r = api.speed("llama-3-70b", context=4096, tp=1)
    (m,) = r.models
    assert m.points[0].tp == 1 and m.points[0].fits is False and m.weights_fit is False
    assert "do not fit" in m.fit_warning and r.fits is False


# -- simulate ----------------------------------------------------------------------------------------------------

def test_simulate_a_rate():
    r = api.simulate("llama-3-8b", rate=2, requests=50)
    assert isinstance(r, api.SimulateResult)
    (p,) = r.points
    assert (p.label, p.mode, p.rate, p.concurrency, p.completed) == ("run", "rate", 2.0, None, 50)
    # the KV pool: 80 GB - 8 GB reserve - 16.06 GB weights, in blocks of 16 tokens x 131,072 B
    assert p.kv_blocks == 55_939_477_504 // (16 * LLAMA8_KV) == 26_674
    assert p.ttft_s["p50"] <= p.ttft_s["p90"] <= p.ttft_s["p99"]
    assert p.output_token_throughput == pytest.approx(p.request_throughput * 128)  # 128 output tokens each
    assert r.to_dict()["points"][0]["pool"]["block_bytes"] == 16 * LLAMA8_KV


def test_simulate_a_sweep_and_its_progress():
    seen = []

    class Status:  # what the CLI's status line gets
        def __init__(self, what):
            seen.append(what)

        def __enter__(self):
            return lambda t, done: None

        def __exit__(self, *exc):
            return False

    r = api.simulate("llama-3-8b", concurrency=2, requests=10, sweep=["tp=1,2"], progress=Status)
    assert [(p.label, p.tp, p.gpus, p.completed) for p in r.points] == [("tp=1", 1, 1, 10), ("tp=2", 2, 2, 10)]
    assert seen == ["tp=1: concurrency 2 ...", "tp=2: concurrency 2 ..."]


# -- validate ----------------------------------------------------------------------------------------------------

@pytest.fixture
def quick_scoring(monkeypatch):
    """The leave-one-out scoring (minutes) replaced by a table of two rows' summary."""
    from kvwall.predict import validate as scoring

    summary = {"checked": 2, "skipped": 1, "all": {"n": 2, "median_abs_error": 0.1, "median_error": -0.05,
                                                   "max_abs_error": 0.15, "worst": "row-b"},
               "engines": {}, "devices": {}}
    loso = {**summary, "all": {**summary["all"], "median_abs_error": 0.3}}  # held out by source: worse
    fake = {"mode": "ideal", "conventions": {}, "fit": scoring.fit_info(), "rows": [{"id": "row-a"}, {"id": "row-b"}],
            "summary": summary, "summaries": {"ideal": summary, "expected": summary, "expected_loso": loso}}
    calls = []
    monkeypatch.setattr(scoring, "validate", lambda rows, engine, device, mode: calls.append((engine, device, mode))
                        or json.loads(json.dumps(fake)))
    return calls


def test_validate_wraps_the_scoring(quick_scoring, capsys):
    r = api.validate(engine="gpt-fast", mode="ideal")
    assert isinstance(r, api.ValidateResult)
    assert quick_scoring == [("gpt-fast", None, "ideal")]
    assert (r.mode, r.rows, r.checked, r.skipped) == ("ideal", 2, 2, 1)
    assert (r.median_abs_error, r.median_error, r.max_abs_error, r.worst) == (0.1, -0.05, 0.15, "row-b")
    assert r.loso_median_abs_error == 0.3  # expected mode's leave-one-source-out median, whatever the mode
    assert r.fit_written is None
    assert r.to_dict() == cli_json(capsys, "validate", "--engine", "gpt-fast", "--mode", "ideal")


def test_validate_refuses_before_scoring(quick_scoring):
    with pytest.raises(KvwallError, match="engine 'nosuch'"):
        api.validate(engine="nosuch")
    with pytest.raises(KvwallError, match="add --fit"):
        api.validate(out="table.json")
    with pytest.raises(KvwallError, match="mode must be one of expected, ideal"):
        api.validate(mode="best")
    assert quick_scoring == []


# -- one convention, one implementation -------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda: api.memory("llama-3-8b", batch=0), "batch must be at least 1 (got 0)"),
    (lambda: api.memory("llama-3-8b", batch=True), "batch must be a number"),
    (lambda: api.memory("llama-3-8b", context="lots"), "bad context 'lots'"),
    (lambda: api.memory("llama-3-8b", device="nosuch"), "nosuch"),
    (lambda: api.memory("llama-3-8b", kv_format="bogus"), "bogus"),
    (lambda: api.memory("llama-3-8b", kv_heads=3), "must divide the query heads"),
    (lambda: api.memory("llama-3-8b", tp=2, ep=2), "not both"),
    (lambda: api.memory("no-such-model"), "unknown model"),
    (lambda: api.memory(42), "model must be a name, a path or a ModelSpec"),
    (lambda: api.fit("llama-3-8b", batch=2, context="4k"), "not both"),
    (lambda: api.fit("llama-3-8b", memory="80GB", device="h100-sxm"), "give one"),
    (lambda: api.roofline("llama-3-8b", mla="naive"), "no MLA"),
    (lambda: api.roofline("llama-3-8b", compute_eff=0.7), "add --ideal"),
    (lambda: api.roofline("llama-3-8b", ideal=True, compute_eff=2), "compute_eff must be a finite number in (0, 1]"),
    (lambda: api.roofline("llama-3-8b", micro_batches=2), "needs pipeline stages"),
    (lambda: api.roofline("llama-3-8b", batch="1,x"), "bad batch"),
    (lambda: api.speed([]), "at least one model"),
    (lambda: api.simulate("llama-3-8b", requests=5), "say how requests come"),
    (lambda: api.simulate("llama-3-8b", rate=1, concurrency=2), "not both"),
    (lambda: api.simulate("llama-3-8b", find_rate=True), "needs an SLO"),
    (lambda: api.simulate("llama-3-8b", rate=1, sweep={"nosuch": [1]}), "bad --sweep"),
])
def test_bad_arguments_are_one_line_errors(call, message):
    with pytest.raises(KvwallError) as exc:
        call()
    text = str(exc.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize("argv, name", [
    (["memory", "llama-3-8b"], "memory"), (["fit", "llama-3-8b"], "fit"), (["compare", "llama-3-8b"], "compare"),
    (["roofline", "llama-3-8b"], "roofline"), (["speed", "llama-3-8b"], "speed"),
    (["simulate", "llama-3-8b", "--rate", "1"], "simulate"), (["validate"], "validate"),
])
def test_the_cli_calls_the_api(monkeypatch, capsys, argv, name):
    """Each predictor command's numbers come from kvwall.api (no second implementation)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        raise KvwallError("spied")

    real = getattr(api, name)
    monkeypatch.setattr(api, name, spy)
    assert main([*argv, "--json"]) == 2
    assert "spied" in capsys.readouterr().err
    assert len(calls) == 1
    args, kwargs = calls[0]
    assert set(kwargs) <= set(inspect.signature(real).parameters)  # the API's own keyword names


def test_the_cli_takes_prompt_tokens_too(capsys):
    a = cli_json(capsys, "roofline", "llama-3-8b", "--prompt-tokens", "8k")
    assert a["prompt"] == 8192 and a == api.roofline("llama-3-8b", prompt_tokens="8k").to_dict()


def test_results_are_frozen_and_to_dict_is_a_copy():
    r = api.memory("llama-3-8b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.cache_bytes = 0
    d = r.to_dict()
    d["cache_bytes"] = 0
    assert r.to_dict()["cache_bytes"] == 4096 * LLAMA8_KV


def test_every_public_name_is_documented():
    for name in api.__all__:
        obj = getattr(api, name)
        doc = inspect.getdoc(obj) or ""
        assert doc, name
        if inspect.isfunction(obj):
            assert "Args:" in doc and "Returns:" in doc, name
            assert inspect.signature(obj).return_annotation.endswith("Result"), name
        else:
            assert dataclasses.is_dataclass(obj) and "Attributes:" in doc, name
            documented = doc.split("Attributes:")[1]
            for f in dataclasses.fields(obj):
                if not f.name.startswith("_"):
                    assert f"{f.name}:" in documented, (name, f.name)


def test_the_keyword_convention_is_shared():
    """The shared options have one name everywhere they apply."""
    shared = {"kv_heads", "window", "weight_format", "kv_format", "state_format"}
    for fn in (api.memory, api.fit, api.compare, api.roofline, api.speed, api.simulate):
        assert shared <= set(inspect.signature(fn).parameters), fn.__name__
    for fn in (api.memory, api.fit, api.roofline, api.speed, api.simulate):
        assert {"tp", "pp", "ep", "device"} <= set(inspect.signature(fn).parameters), fn.__name__
    for fn in (api.roofline, api.speed, api.simulate):
        assert {"prompt_tokens", "ideal", "compute_dtype"} <= set(inspect.signature(fn).parameters), fn.__name__


def test_the_package_root_re_exports_and_stays_light():
    assert kvwall.memory is api.memory and kvwall.FitResult is api.FitResult
    import kvwall.simulate as sim_module  # the simulator's module keeps its name

    assert kvwall.simulate is sim_module
    code = ("import sys, kvwall, kvwall.api; kvwall.memory; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_py_typed_ships():
    from importlib.resources import files

    assert files("kvwall").joinpath("py.typed").is_file()
