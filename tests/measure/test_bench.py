"""kvwall bench: one small point end to end; the engine cache's bytes equal the predictor's."""

import json

import pytest

pytest.importorskip("torch")

from kvwall.cli import main  # noqa: E402

PROFILE = {"memory_bytes": 8 * 2**30, "memory_bandwidth_Bps": 20e9, "peak_flops": {"fp32": 1e11},
           "source": "test profile", "notes": []}


@pytest.fixture
def local_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text(json.dumps(PROFILE))


@pytest.mark.parametrize("arch", ["gqa", "gqa-int8", "hybrid"])  # hybrid: KV on 3 layers + Mamba state
def test_bench_point(arch, local_profile, capsys):
    assert main(["bench", arch, "--context", "256", "--steps", "1", "--prefill-max", "256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (r,) = data["results"]
    assert r["arch"] == arch and r["context"] == 256
    assert r["cache_bytes"] == r["cache_pred_bytes"]  # the engine's cache holds what the predictor says
    assert r["decode_error"] == pytest.approx(r["decode_pred_s"] / r["decode_s"] - 1)
    assert r["prefill_s"] > 0 and r["prefill_pred_s"] > 0
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


def test_summary_counts_and_explains_outside_points():
    from kvwall.measure.archs import ARCHS
    from kvwall.measure.bench import summary

    rows = [{"arch": "gqa", "context": 1024, "decode_bound": "memory", "decode_error": -0.05, "within_goal": True},
            {"arch": "gqa-int4", "context": 1024, "decode_bound": "memory", "decode_error": -0.5, "within_goal": False},
            {"arch": "gqa-int4", "context": 4096, "decode_bound": "memory", "decode_error": -0.7, "within_goal": False}]
    s = summary(rows, [ARCHS["gqa"], ARCHS["gqa-int4"]])
    assert (s["bandwidth_bound_points"], s["within_goal"]) == (3, 1)
    assert s["outside_goal"] == ["gqa-int4@1024", "gqa-int4@4096"]
    assert s["max_abs_error_bandwidth_bound"] == 0.7
    assert "packed bytes" in s["reasons"]["gqa-int4"]


def test_bench_a_model_directory(tmp_path, local_profile, capsys):
    """A checkpoint directory runs with its own weights; its cache bytes equal the predictor's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    assert main(["bench", str(tmp_path / "tiny"), "--context", "64", "--steps", "1", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    assert r["arch"] == "tiny" and r["cache_bytes"] == r["cache_pred_bytes"] == 2 * 2 * 2 * 16 * 4 * (64 + 3)
