"""kvwall bench: one small point end to end; the engine cache's bytes equal the predictor's."""

import json

import pytest

pytest.importorskip("torch")

from kvwall.cli import main

PROFILE = {"memory_bytes": 8 * 2**30, "memory_bandwidth_Bps": 20e9, "peak_flops": {"fp32": 1e11},
           "source": "test profile", "notes": []}


@pytest.fixture
def local_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text(json.dumps(PROFILE))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gqa", "gqa-int8", "hybrid"])  # hybrid: KV on 3 layers + Mamba state
def test_bench_point(arch, local_profile, capsys):
    assert main(["bench", arch, "--context", "256", "--steps", "1", "--prefill-max", "256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (r,) = data["results"]
    assert r["arch"] == arch and r["context"] == 256
    assert r["cache_bytes"] == r["cache_pred_bytes"]  # the engine's cache holds what the predictor says
    assert r["cache_read_pred_Bps"] == 20e9  # the test profile has no per-kernel figures: its read bandwidth
    assert r["prefill_s"] > 0 and r["prefill_pred_s"] > 0
    assert len(r["prefill_runs_s"]) == 3 and r["prefill_s"] == sorted(r["prefill_runs_s"])[1]  # median of three
    assert r["peak_rss_bytes"] > 4 * r["params"]  # fp32 weights are resident
    assert data["machine"]["bandwidth_Bps"] == 20e9


def test_bench_skips_what_does_not_fit(local_profile, capsys, monkeypatch):
    from kvwall.measure import bench

    monkeypatch.setattr(bench, "available_memory", lambda: 2**30)
    assert main(["bench", "mha", "--context", "1k", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["results"] == [] and "GiB available" in data["skipped"][0]["reason"]


def test_bench_unknown_arch(local_profile):
    assert main(["bench", "no-such-arch"]) == 2


def test_errors_from_fixed_measurements(monkeypatch):
    """run() with the worker and the roofline replaced by fixed numbers: 15 ms predicted against 10 ms measured is
    +50%, a 2 s predicted prefill against 4 s measured is -50%."""
    from kvwall.measure import bench
    from kvwall.measure.archs import ARCHS

    line = {"arch": "gqa", "context": 256, "decode_s": 0.010, "prefill_s": 4.0, "cache_bytes": 1}
    monkeypatch.setattr(bench, "_worker", lambda job: iter([dict(line)]))
    monkeypatch.setattr(bench, "predict", lambda *a: {"decode_pred_s": 0.015, "decode_bound": "memory",
                                                       "prefill_pred_s": 2.0, "cache_pred_bytes": 1})
    (r,) = bench.run(bench.Plan([ARCHS["gqa"]], [256]), device=None)
    assert r["decode_error"] == pytest.approx(0.5) and r["prefill_error"] == pytest.approx(-0.5)
    assert r["within_goal"] is False


def point(arch, context, measured_ms, predicted_ms, cache_bytes, profile_Bps=20e9):
    error = predicted_ms / measured_ms - 1
    return {"arch": arch, "context": context, "decode_s": measured_ms / 1e3, "decode_pred_s": predicted_ms / 1e3,
            "decode_error": error, "decode_bound": "memory", "within_goal": abs(error) <= 0.2,
            "cache_bytes": cache_bytes, "cache_read_pred_Bps": profile_Bps}


def test_summary_counts_outside_points():
    from kvwall.measure.bench import summary

    rows = [point("gqa", 1024, 10, 9.5, 10**8), point("gqa-int4", 1024, 20, 10, 10**8),
            point("gqa-int4", 4096, 40, 12, 4 * 10**8)]
    s = summary(rows)
    assert (s["bandwidth_bound_points"], s["within_goal"]) == (3, 1)
    assert s["outside_goal"] == ["gqa-int4@1024", "gqa-int4@4096"]
    assert s["max_abs_error_bandwidth_bound"] == pytest.approx(0.7)  # 12 / 40 - 1
    assert list(s["reasons"]) == ["gqa-int4"]


def test_reason_reads_the_cache_speed_from_the_slope():
    """Predicted 10 ms + bytes / 20 GB/s, measured 10 ms + bytes / 10 GB/s, over 100 MB and 400 MB of cache:
    5 ms and 20 ms slower (-25%, -40%); the slope 30 ms / 300 MB is 10 GB/s. A slower MHA is never called faster."""
    from kvwall.measure.bench import summary

    rows = [point("mha", 1024, 20, 15, 100 * 10**6), point("mha", 4096, 50, 30, 400 * 10**6)]
    why = summary(rows)["reasons"]["mha"]
    assert "5.0 ms slower than predicted at 1k (-25%)" in why and "20.0 ms slower than predicted at 4k (-40%)" in why
    assert "this run read the cache at 10.0 GB/s, the profile 20.0 GB/s" in why
    assert "faster" not in why and "fixed" not in why


def test_reason_names_a_constant_gap_a_fixed_cost():
    """Predicted 10 ms at both contexts, measured 16.0 and 16.4 ms: about 6.2 ms per step, whatever the bytes."""
    from kvwall.measure.bench import summary

    rows = [point("mamba", 1024, 16.0, 10, 10**6), point("mamba", 4096, 16.4, 10, 10**6)]
    why = summary(rows)["reasons"]["mamba"]
    assert "6.0 ms slower than predicted at 1k (-38%)" in why and "6.4 ms slower than predicted at 4k (-39%)" in why
    assert "a fixed cost of about 6.2 ms per step that the profile does not count" in why
    assert "GB/s" not in why


def test_reason_from_one_point_claims_only_the_gap():
    from kvwall.measure.bench import summary

    why = summary([point("mha", 1024, 10, 20, 10**8)])["reasons"]["mha"]
    assert why.startswith("measured decode is 10.0 ms faster than predicted at 1k (+100%);")
    assert "one context cannot tell" in why and "GB/s" not in why and "slower" not in why


def test_reason_with_a_fixed_part_and_a_slope():
    """Measured 20 ms + bytes / 10 GB/s against predicted 10 ms + bytes / 20 GB/s: 10 ms fixed beside the slope."""
    from kvwall.measure.bench import summary

    rows = [point("mqa", 1024, 30, 15, 100 * 10**6), point("mqa", 4096, 60, 30, 400 * 10**6)]
    why = summary(rows)["reasons"]["mqa"]
    assert "read the cache at 10.0 GB/s" in why and "plus a fixed 10.0 ms per step more than predicted" in why


@pytest.mark.slow
def test_bench_a_model_directory(tmp_path, local_profile, capsys):
    """A checkpoint directory runs with its own weights; its cache bytes equal the predictor's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    assert main(["bench", str(tmp_path / "tiny"), "--context", "64", "--steps", "1", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    # K and V, 2 layers, 2 KV heads x 16, fp32, for 64 tokens + 2 warm-up, 1 timed and 4 profiled steps
    assert r["arch"] == "tiny" and r["cache_bytes"] == r["cache_pred_bytes"] == 2 * 2 * 2 * 16 * 4 * (64 + 2 + 1 + 4)


@pytest.mark.slow
def test_worker_times_no_first_call(monkeypatch, capsys):
    """A model whose first call takes 1 s (a kernel build, thread start): no prefill or decode time counts it."""
    import time

    from kvwall.measure import bench_worker

    calls = []

    def slow_first(build):
        def make(job):
            model = build(job)
            forward = model.forward

            def wrapped(*a, **kw):
                if not calls:
                    time.sleep(1.0)
                calls.append(1)
                return forward(*a, **kw)

            model.forward = wrapped
            return model
        return make

    monkeypatch.setattr(bench_worker, "build", slow_first(bench_worker.build))
    cfg = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, torch_dtype="float32")
    job = {"name": "tiny", "config": cfg, "cache": "contiguous", "contexts": [32], "steps": 2, "warmup": 0,
           "prefill_max": 32, "threads": 1, "checkpoint": None}
    assert bench_worker.main([json.dumps(job)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["threads"] == 1  # the job's thread count, as torch reports it in the worker
    assert r["prefill_s"] < 0.5 and max(r["decode_runs_s"]) < 0.5, (r["prefill_s"], r["decode_runs_s"])
    assert len(r["prefill_runs_s"]) == 3 and max(r["prefill_runs_s"]) < 0.5, r["prefill_runs_s"]  # fresh caches


@pytest.mark.slow
def test_bench_a_real_model_against_transformers(tmp_path, local_profile, capsys):
    """A .gguf runs at each batch with each cache and transformers in one process: tok/s is batch over the median
    step, the exact cache's greedy tokens equal transformers', its bytes are the preallocation, and the ratio
    to transformers is the two tok/s divided."""
    import statistics
    import sys
    from pathlib import Path

    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from test_gguf import tiny_hf, write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", gguf.GGMLQuantizationType.F32)
    assert main(["bench", str(path), "--batch", "1,2", "--cache", "contiguous,int8", "--steps", "3", "--threads", "1",
                 "--json"]) == 0
    real = json.loads(capsys.readouterr().out)["real_models"]
    rows = {(r["batch"], r["engine"]): r for r in real["results"]}
    engines = ("kvwall:contiguous", "kvwall:int8", "transformers")
    assert set(rows) == {(b, e) for b in (1, 2) for e in engines}
    assert {r["threads"] for r in rows.values()} == {1}  # --threads 1 for kvwall and transformers alike
    for (batch, engine), r in rows.items():
        assert len(r["step_runs_s"]) == 3 and r["step_s"] == statistics.median(r["step_runs_s"])
        assert r["tok_s"] == pytest.approx(batch / r["step_s"])
        if engine != "transformers":
            assert r["vs_transformers"] == pytest.approx(r["tok_s"] / rows[batch, "transformers"]["tok_s"])
            assert r["pred_tok_s"] == pytest.approx(batch / r["pred_step_s"]) and r["pred_step_s"] > 0
    for batch in (1, 2):
        r = rows[batch, "kvwall:contiguous"]
        assert r["same_tokens_as_transformers"] is True
        # batch x (16 prompt + 2 warm-up + 3 timed + 1) slots x 2 layers x 2 KV heads x (16 + 16) x 4 bytes
        assert r["cache_bytes"] == batch * 22 * 2 * 2 * 32 * 4
    assert set(real["summary"]["contiguous_vs_transformers"]) == {"tiny:fp32@1", "tiny:fp32@2"}


@pytest.mark.slow
def test_bench_a_real_model_by_weight_format(tmp_path, local_profile, capsys):
    """--weights fp32,int8:g32: one kvwall engine per format in the same run; int8's greedy tokens are its own
    (not asserted), and its predicted step reads 73,728 projection weights x (4 - 1.125) bytes fewer (2 layers
    x (q 64x64 + k, v 64x32 + o 64x64 + gate, up, down 64x128); int8:g32 = 1 + 4/32 bytes a weight)."""
    import sys
    from pathlib import Path

    gguf = pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from test_gguf import tiny_hf, write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", gguf.GGMLQuantizationType.F32)
    argv = ["bench", str(path), "--batch", "1", "--cache", "contiguous", "--steps", "2", "--weights", "fp32,int8:g32",
            "--json"]
    assert main(argv) == 0
    real = json.loads(capsys.readouterr().out)["real_models"]
    rows = {(r["engine"], r["weights"]): r for r in real["results"]}
    assert set(rows) == {("kvwall:contiguous", "fp32"), ("kvwall:contiguous", "int8:g32"), ("transformers", "fp32")}
    assert real["weights"] == ["fp32", "int8:g32"]
    fp32, int8 = rows["kvwall:contiguous", "fp32"], rows["kvwall:contiguous", "int8:g32"]
    assert fp32["pred_bytes"] - int8["pred_bytes"] == pytest.approx(73728 * (4 - 1.125))
    assert rows["kvwall:contiguous", "fp32"]["same_tokens_as_transformers"] is True


def test_bench_weights_on_a_model_directory_is_one_line(tmp_path, local_profile, capsys):
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from tiny_checkpoints import make_checkpoint

    make_checkpoint("llama", tmp_path / "tiny")
    capsys.readouterr()  # transformers' progress bar while saving it
    assert main(["bench", str(tmp_path / "tiny"), "--batch", "1", "--weights", "native", "--steps", "1"]) == 2
    err = capsys.readouterr().err  # a model directory runs the fp32 context sweep: --weights is refused, not ignored
    assert err.startswith("kvwall: error:") and "--weights" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", [["--batch", "0"], ["--batch", "1,x"], ["--cache", "int3"], ["--cache", "int4:q"]])
def test_bench_real_model_options_are_one_line_errors(bad, local_profile, capsys):
    assert main(["bench", "missing.gguf", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwall: error:") and ("batch" in err or "cache" in err) and "missing.gguf" not in err


@pytest.mark.slow
def test_a_busy_machine_is_named(monkeypatch, capsys):
    """Another process spinning one CPU for the whole of a worker's second is half of a 2-core machine's
    CPUs (a quarter of 4): the bench records it against that architecture and says its timings are busy."""
    import os
    import subprocess
    import sys
    import time

    from kvwall.commands.bench_cmd import print_results
    from kvwall.measure import bench
    from kvwall.measure.archs import ARCHS

    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"

    def busy_worker(job):
        # started through a shell that exits at once: the spinner is no child of ours, so it counts as others'
        subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{spin}" &'], check=True)
        time.sleep(1.0)
        yield {"arch": "gqa", "context": 256, "decode_s": 0.010, "cache_bytes": 1, "peak_rss_bytes": 1}

    monkeypatch.setattr(bench, "_worker", busy_worker)
    monkeypatch.setattr(bench, "predict", lambda *a: {"decode_pred_s": 0.010, "decode_bound": "memory",
                                                       "cache_pred_bytes": 1})
    (r,) = results = bench.run(bench.Plan([ARCHS["gqa"]], [256]), device=None)
    assert r["others_cpu_share"] >= 0.5 / (os.cpu_count() or 1)  # 1 of the CPUs, less start-up slack
    s = bench.summary(results)
    assert s["busy_archs"] == ["gqa"] and s["others_cpu_share_max"] == r["others_cpu_share"]
    data = {"machine": {"host": "h", "cpu_count": 2, "bandwidth_Bps": 1e10}, "steps": 1, "seconds": 1.0,
            "results": results, "skipped": [], "summary": s}
    print_results(data)
    out = capsys.readouterr().out
    assert "other processes used up to" in out and "gqa ran" in out
