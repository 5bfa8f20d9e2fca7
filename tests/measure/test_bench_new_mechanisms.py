"""`kvwall bench`'s architectures for the 2025-26 mechanisms: each parsed into the layers its family builds, its
parameters equal to transformers 5.25's model of the same config (built on the meta device) and inside the bench's
matched size, its cache bytes by hand; the step split into parts (mixers, channel mixers, the rest) adds up to the
prediction, and a miss names the part and the speed it reached."""

from __future__ import annotations

import json

import pytest

from kvwall.measure import bench
from kvwall.measure.archs import ARCHS, LAYERS, Arch
from kvwall.spec.model import Attention, GatedDeltaNet, LatentAttention, ModelSpec

NEW = ["gated_deltanet", "kda", "lightning", "dsa", "sinks", "chunked", "short_conv", "parallel_hybrid"]
LOW, HIGH = 121.1e6, 144.5e6  # the band today's bench models span (mqa to hybrid), archs.py's docstring


def spec_of(name: str) -> ModelSpec:
    return bench.arch_spec(ARCHS[name])


def kinds(spec: ModelSpec) -> list[str]:
    return [layer.mixer.kind for layer in spec.layers]


def test_each_mechanism_is_a_bench_architecture_of_the_matched_shape():
    for name in NEW:
        spec = spec_of(name)
        assert (spec.vocab, spec.hidden, spec.n_layers) == (32000, 768, LAYERS), name
        assert LOW <= spec.params() <= HIGH, (name, spec.params())
    one_of_four = lambda a, b: [a, a, a, b] * 3  # noqa: E731  (3 : 1, the 4th of each 4 the other)
    assert kinds(spec_of("kda")) == one_of_four("kda", "latent")
    assert kinds(spec_of("lightning")) == ["attention", "lightning"] * 6  # even layers softmax (transformers)
    assert kinds(spec_of("dsa")) == ["sparse_latent"] * 12
    assert kinds(spec_of("short_conv")) == ["attention" if i in (2, 5, 8, 10) else "short_conv" for i in range(12)]
    assert kinds(spec_of("parallel_hybrid")) == ["parallel_hybrid"] * 12
    sinks = [layer.mixer for layer in spec_of("sinks").layers]
    assert [a.window for a in sinks] == [128, None] * 6 and all(a.sinks for a in sinks)
    chunked = [layer.mixer for layer in spec_of("chunked").layers]
    assert [a.chunk for a in chunked] == one_of_four(8192, None)
    assert [a.rope is None for a in chunked] == one_of_four(False, True)  # the global layers are NoPE
    assert all(isinstance(a, Attention) for a in sinks + chunked)
    dsa = spec_of("dsa").layers[0].mixer
    assert dsa.index_topk == 2048 < 32768  # selection matters at the longest bench contexts
    assert isinstance(spec_of("kda").layers[3].mixer, LatentAttention)
    assert isinstance(spec_of("gated_deltanet").layers[0].mixer, GatedDeltaNet)


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_parameters_equal_transformers_model_of_the_same_config(name):
    torch = pytest.importorskip("torch")
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = dict(ARCHS[name].config)
    config = CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
    with torch.device("meta"):  # shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(config)
    assert spec_of(name).params() == sum(p.numel() for p in model.parameters())


# the bench's cache bytes (bench.predicted_cache_bytes: the cache registry's figure for the arch's cache, fp32) for a
# cache holding T tokens, by hand. fp32 = 4 B; GQA-4 K and V: 2 x 4 heads x 64 x 4 B = 2,048 B per token and layer.
def test_sinks_cache_bytes_by_hand():
    # gpt-oss-style on the sliding cache: 6 full layers keep every token, the 6 windowed ones a ring of 128
    arch = ARCHS["sinks"]
    assert arch.cache == "sliding"
    for T in (1024, 32768):
        assert bench.predicted_cache_bytes(arch, spec_of("sinks"), T) == 6 * 2048 * T + 6 * 2048 * 128
    assert bench.predicted_cache_bytes(arch, spec_of("sinks"), 1024) == 14_155_776
    assert bench.predicted_cache_bytes(arch, spec_of("sinks"), 32768) == 404_226_048


def test_kda_cache_bytes_by_hand():
    # 3 NoPE MLA layers: a 256-d latent + the 32-d key per token, 288 x 4 B = 1,152 B per token and layer;
    # 9 KDA layers: 12 heads x 64 x 64 state, 49,152 floats, and the q, k and v short convolutions' state, 3 x 768
    # channels x 4 taps (the kernel's width, as transformers keeps it), 9,216 floats
    arch, spec = ARCHS["kda"], spec_of("kda")
    state = 9 * (12 * 64 * 64 + 3 * 768 * 4) * 4
    assert state == 2_101_248
    assert bench.predicted_cache_bytes(arch, spec, 1024) == 3 * 1152 * 1024 + state == 5_640_192
    assert bench.predicted_cache_bytes(arch, spec, 32768) == 3 * 1152 * 32768 + state == 115_347_456


def test_chunked_cache_bytes_by_hand():
    # Llama-4-style on the sliding cache: 3 NoPE global layers keep every token, 9 chunked ones a ring of one chunk
    arch, spec = ARCHS["chunked"], spec_of("chunked")
    assert bench.predicted_cache_bytes(arch, spec, 1024) == 12 * 2048 * 1024 == 25_165_824
    assert bench.predicted_cache_bytes(arch, spec, 32768) == 3 * 2048 * 32768 + 9 * 2048 * 8192 == 352_321_536


PROFILE = {"memory_bytes": 8 * 2**30, "memory_bandwidth_Bps": 20e9, "peak_flops": {"fp32": 1e11},
           "layer_overhead_s": 0.002, "step_overhead_s": 0.001, "source": "test profile", "notes": []}


@pytest.fixture
def device(tmp_path, monkeypatch):
    from kvwall.predict.devices import local_device

    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text(json.dumps(PROFILE))
    return local_device()


def test_the_parts_add_up_to_the_predicted_step(device):
    arch = ARCHS["gated_deltanet"]
    p = bench.predict(arch, spec_of("gated_deltanet"), 4096, device, 0, 4096)
    parts = p["parts_pred"]
    assert set(parts) == {"mixer:gated_deltanet", "mixer:attention", "ffn:mlp", "rest"}
    assert [parts[k]["layers"] for k in ("mixer:gated_deltanet", "mixer:attention", "ffn:mlp")] == [9, 3, 12]
    assert sum(q["pred_s"] for q in parts.values()) == pytest.approx(p["decode_pred_s"], rel=1e-12)
    assert parts["mixer:gated_deltanet"]["overhead_s"] == pytest.approx(9 * 0.002)  # its layers' dispatch
    assert parts["rest"]["overhead_s"] == pytest.approx(0.001)  # the step's own
    # the state each Gated DeltaNet layer reads and writes: 12 heads x 64 x 64 fp32, read once and written once
    # (the test profile's fp32 state) and its conv state, as the predictor's ops count it
    assert parts["mixer:gated_deltanet"]["read_bytes"] >= 9 * 2 * 12 * 64 * 64 * 4
    assert parts["ffn:mlp"]["read_bytes"] == 0 and parts["ffn:mlp"]["weight_bytes"] == 12 * 3 * 768 * 2048 * 4


def test_a_slow_part_is_named_with_the_speed_it_reached(device):
    """By hand: a mixer predicted at 2 ms of matmuls + 1 ms of dispatch + 1 ms reading 20 MB (at 20 GB/s), measured
    at 13 ms, leaves 10 ms for the 20 MB: 2 GB/s, 0.1 of the calibrated 20 GB/s."""
    predicted = {"mixer:x": dict(layers=3, pred_s=0.004, overhead_s=0.001, weight_s=0.002, weight_bytes=40e6,
                                 read_bytes=20e6),
                 "ffn:mlp": dict(layers=3, pred_s=0.005, overhead_s=0.0, weight_s=0.005, weight_bytes=100e6,
                                 read_bytes=0.0)}
    rows = bench.parts_table({"mixer:x": 0.013, "ffn:mlp": 0.010, "rest": 0.001, "step": 0.024}, predicted, device)
    by = {r["part"]: r for r in rows}
    assert by["mixer:x"]["read_Bps"] == pytest.approx(2e9) and by["mixer:x"]["share_of_calibrated"] == \
        pytest.approx(0.1)
    assert by["ffn:mlp"]["weight_Bps"] == pytest.approx(10e9)  # 100 MB in 10 ms: half the calibrated rate
    row = {"arch": "x", "context": 4096, "decode_s": 0.024, "decode_pred_s": 0.009, "decode_error": 0.009 / 0.024 - 1,
           "cache_bytes": 1, "parts": rows}
    why = bench.explain([row])
    assert "(measured / predicted: the x mixer 3.2x, the mlp channel mixer 2.0x)" in why
    assert "the x mixer (3 layers): 13.0 ms against 4.0 ms predicted" in why
    assert "2.00 GB/s, 0.10 of the calibrated read bandwidth" in why


@pytest.mark.slow
def test_the_worker_times_each_part_of_a_step():
    """A tiny Qwen3.5-style model (2 Gated DeltaNet layers + 1 attention layer): the worker's per-part times are
    positive for each mixer kind and the channel mixers; the cache holds the profiled steps too, as predicted."""
    pytest.importorskip("torch")
    from kvwall.measure import bench_worker

    cfg = dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["linear_attention"] * 2 +
               ["full_attention"], linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
               torch_dtype="float32")
    job = {"name": "tiny", "config": cfg, "cache": "contiguous", "contexts": [16], "steps": 2, "warmup": 1,
           "prefill_max": 16, "threads": 1, "checkpoint": None, "profile_steps": 3}
    model = bench_worker.build(job)
    r = bench_worker.run_point(model, job, 16)
    parts = r["parts_s"]
    assert set(parts) == {"mixer:gated_deltanet", "mixer:attention", "ffn:mlp", "rest", "step"}
    assert all(parts[k] > 0 for k in ("mixer:gated_deltanet", "mixer:attention", "ffn:mlp"))
    arch = Arch("tiny", cfg, "contiguous", "fp32", "")
    held = 16 + 1 + 2 + 3  # context, warm-up, timed and profiled steps
    assert r["cache_bytes"] == bench.predicted_cache_bytes(arch, bench.arch_spec(arch), held)
