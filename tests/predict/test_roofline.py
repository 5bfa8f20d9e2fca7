"""Roofline FLOPs, bytes and time: hand counts on a tiny spec, and the source documents' closed forms."""

import pytest

from kvwall.predict.devices import get_device
from kvwall.predict.memory import Formats, Parallel, memory
from kvwall.predict.mixers.moe import expected_experts
from kvwall.predict.ops import step_ops
from kvwall.predict.roofline import Roof, compute_bound_batch, decode, expected_tokens, prefill, speculative
from kvwall.predict.step import Step
from kvwall.spec.formats import get_format
from kvwall.spec.model import MLP, Attention, Layer, ModelSpec
from kvwall.spec.resolve import load_spec

FP16 = get_format("fp16")
F16 = Formats(FP16, FP16, FP16)
TINY = ModelSpec("tiny", "test", hidden=64, vocab=100,
                 layers=(Layer(Attention(4, 2, 16, 16), MLP(128), 128),))


def test_tiny_decode_by_hand():
    ops = {o.name: o for o in step_ops(TINY, Step(batch=1, past=9, new=1), F16)}
    assert ops["qkv_proj"].flops == 2 * 64 * (4 * 16 + 2 * 32)          # 16,384
    assert ops["qkv_proj"].weight_bytes == 64 * 128 * 2
    # one query over 10 keys, 4 heads, QK (16) + AV (16) multiply-adds
    assert ops["attention"].flops == 2 * 4 * 32 * 10
    assert ops["attention"].cache_read == 10 * 2 * 32 * 2               # 10 tokens x 2 KV heads x (K+V) x 2 B
    assert ops["attention"].cache_write == 2 * 32 * 2
    assert ops["mlp"].flops == 3 * 2 * 64 * 128
    assert ops["lm_head"].flops == 2 * 64 * 100
    assert sum(o.flops for o in ops.values()) == 16384 + 2560 + 8192 + 49152 + 12800


def test_causal_pairs_with_window():
    assert Step(1, 0, 4).pairs(None) == 1 + 2 + 3 + 4
    assert Step(1, 0, 4).pairs(2) == 1 + 2 + 2 + 2
    assert Step(1, 9, 1).pairs(4) == 4
    assert Step(1, 2, 3).pairs(None) == 3 + 4 + 5


def test_h100_machine_balance():
    roof = Roof(get_device("h100-sxm"))
    assert roof.balance == pytest.approx(989e12 / 3.35e12)
    assert round(roof.balance) == 295


def test_decode_attention_intensity_is_about_one_in_fp16():
    spec = load_spec("gpt2-xl")  # MHA: every query head has its own K/V
    r = decode(spec, 4096, 1, F16, Roof(get_device("h100-sxm")))
    att = [o for o in r.ops if o.name == "attention"]
    flops, nbytes = sum(o.flops for o in att), sum(o.bytes for o in att)
    assert flops / nbytes == pytest.approx(1.0, rel=0.01)


def test_decode_at_least_bytes_over_bandwidth():
    roof = Roof(get_device("h100-sxm"))
    for name in ("llama-3-8b", "gemma-3-27b", "mamba-2.8b", "jamba-v0.1"):
        spec = load_spec(name)
        fm = Formats.for_spec(spec)
        rep = memory(spec, batch=1, context=8192, formats=fm)
        # weights one token reads: the active parameters (MoE: top-k experts), less an untied input embedding
        # table of which only one row is gathered; 2 bytes each in bf16
        read = spec.active_params() - spec.extra_params - (0 if spec.tied_embeddings else spec.vocab * spec.hidden)
        floor = (2 * read + rep.cache_bytes) / roof.bandwidth
        t = decode(spec, 8192, 1, fm, roof).time_s
        assert t >= floor
        assert t < 1.1 * floor  # batch 1 decode is bandwidth-bound: little beyond the floor


def test_mamba_decode_flat_and_sliding_bends():
    roof = Roof(get_device("h100-sxm"))
    mamba, mistral = load_spec("mamba-2.8b"), load_spec("mistral-7b-v0.1")

    def t(s, c):
        return decode(s, c, 1, Formats.for_spec(s), roof).time_s

    assert t(mamba, 1024) == t(mamba, 1 << 20)
    # Mistral-7B v0.1: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 131,072 cache bytes per token, window 4,096
    per_token = 32 * 8 * 128 * 2 * 2
    assert [(x.mixer.cache_elems_per_token(), x.mixer.window) for x in mistral.layers] == [(2 * 8 * 128, 4096)] * 32
    slope = per_token / 3.35e12  # s per token of context, at the H100's 3.35 TB/s
    # below the window each token of context adds its bytes to every step's reads ...
    assert t(mistral, 2048) - t(mistral, 1024) == pytest.approx(1024 * slope, rel=1e-9)
    assert t(mistral, 4096) - t(mistral, 2048) == pytest.approx(2048 * slope, rel=1e-9)
    # ... and past it nothing more is read: exactly flat
    assert t(mistral, 4096) == t(mistral, 4097) == t(mistral, 8192) == t(mistral, 1 << 20)


def test_weights_turn_compute_bound_near_balance():
    spec = load_spec("llama-3-8b")
    roof = Roof(get_device("h100-sxm"))
    b = compute_bound_batch(spec, 4096, Formats.for_spec(spec), roof, scope="weights")
    # bf16 weights: 2 FLOP per 2 bytes per token of batch -> intensity ~ batch; balance 295
    assert 250 < b < 400
    assert compute_bound_batch(spec, 4096, Formats.for_spec(spec), roof, scope="step") is None


def test_mla_absorbed_same_bytes_fewer_flops():
    spec = load_spec("deepseek-v3")
    roof = Roof(get_device("h100-sxm"))
    fm = Formats.for_spec(spec)
    a = decode(spec, 8192, 1, fm, roof, mla_absorbed=True)
    n = decode(spec, 8192, 1, fm, roof, mla_absorbed=False)

    def cache(r):
        return sum(o.cache_read for o in r.ops)

    assert cache(a) == cache(n) == 61 * 8192 * 576 * 2
    assert a.flops * 10 < n.flops


def test_expected_experts():
    assert expected_experts(8, 2, 1) == pytest.approx(2)
    assert expected_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))
    assert expected_experts(256, 8, 10_000) == pytest.approx(256)


def test_expected_tokens_formula():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(1.0, 4) == 5


def test_speculation_stops_paying_with_a_slow_draft():
    spec = load_spec("llama-3-8b")
    fm = Formats.for_spec(spec)
    roof = Roof(get_device("h100-sxm"))
    rows = speculative(spec, spec, 4096, [1, 4], 0.5, fm, fm, roof)  # the draft is as slow as the target
    assert all(r["speedup"] < 1 for r in rows)


def test_tensor_parallel_halves_weights_and_adds_allreduce():
    spec = load_spec("llama-3-8b")
    fm = Formats.for_spec(spec)
    roof = Roof(get_device("h100-sxm"))
    one = decode(spec, 4096, 1, fm, roof)
    two = decode(spec, 4096, 1, fm, roof, Parallel(tp=2))

    def w(r):
        return sum(o.weight_bytes for o in r.ops)

    assert w(two) == pytest.approx(w(one) / 2, rel=0.01)
    assert sum(1 for o in two.ops if o.name == "all-reduce") == 32
    assert two.link_s > 0


def test_gpt_fast_bytes_per_token():
    """gpt-fast (README, A100-80GB, batch 1): Llama-2-7B bf16 104.9 tok/s at 1397.31 GB/s, i.e. 13.32 GB read
    per token. kvwall's bytes per decode step at a short context must agree."""
    spec = load_spec("llama-2-7b")
    fm = Formats.for_spec(spec, weights="bf16", kv="bf16")
    r = decode(spec, 128, 1, fm, Roof(get_device("a100-80gb")))
    assert r.bytes == pytest.approx(1397.31e9 / 104.9, rel=0.02)


def test_prefill_compute_bound_on_long_prompt():
    spec = load_spec("llama-3-8b")
    r = prefill(spec, 4096, 1, Formats.for_spec(spec), Roof(get_device("h100-sxm")))
    assert r.bound == "compute"


def test_layer_overhead_added_once_per_layer_and_head():
    from dataclasses import replace

    roof = Roof(get_device("h100-sxm"))
    slow = Roof(replace(get_device("h100-sxm"), layer_overhead_s=1e-3))
    base = decode(TINY, 10, 1, F16, roof)
    with_overhead = decode(TINY, 10, 1, F16, slow)
    assert with_overhead.time_s == pytest.approx(base.time_s + 2e-3)  # 1 layer + embedding/head
    assert with_overhead.overhead_s == pytest.approx(2e-3) and base.overhead_s == 0


def test_op_bandwidths_split_cache_and_weight_traffic():
    from dataclasses import replace

    dev = replace(get_device("h100-sxm"), op_bandwidth={"attention": 1e12, "matmul": 2e12})
    r = decode(TINY, 10, 1, F16, Roof(dev))
    att = next(o for o in r.ops if o.name == "attention")
    mlp = next(o for o in r.ops if o.name == "mlp")
    roof = Roof(dev)
    assert roof.op_time(att) == pytest.approx(max(att.flops / roof.peak, att.bytes / 1e12))
    assert roof.op_time(mlp) == pytest.approx(max(mlp.flops / roof.peak, mlp.bytes / 2e12))
    assert r.memory_s == pytest.approx(sum(o.bytes / (1e12 if o.cache_read else 2e12) for o in r.ops))


def test_a_quantized_cache_streams_at_its_own_calibrated_bandwidth():
    from dataclasses import replace

    dev = replace(get_device("h100-sxm"), op_bandwidth={"attention": 1e12, "attention:int8": 2.5e11, "matmul": 2e12})
    roof = Roof(dev)
    for kv, bw in [("int8", 2.5e11), ("int4", 1e12), ("fp16", 1e12)]:  # int4 not calibrated: plain attention's
        fm = Formats(get_format("fp16"), get_format(kv), get_format("fp16"))
        att = next(o for o in decode(TINY, 4096, 1, fm, roof).ops if o.name == "attention")
        assert att.kernel == ("attention" if kv == "fp16" else f"attention:{kv}")
        assert roof.op_bandwidth(att) == bw


def test_overhead_by_mixer_kind():
    from dataclasses import replace

    from kvwall.predict.roofline import step_overhead
    from kvwall.spec.model import Mamba

    spec = ModelSpec("mix", "test", 64, 100, (Layer(Attention(4, 2, 16, 16), MLP(128), 128),
                                              Layer(Mamba(128, 16, 4, 4), None, 64)))
    dev = replace(get_device("h100-sxm"), layer_overhead_s=1e-3, mixer_overhead_s={"mamba": 3e-3}, step_overhead_s=5e-4)
    assert step_overhead(spec, dev) == pytest.approx(1e-3 + 3e-3 + 5e-4)


def test_rows_bandwidth_by_hand():
    from kvwall.predict.roofline import rows_bandwidth

    table = {1: 20e9, 4: 8e9, 16: 6e9}
    assert rows_bandwidth(table, 1) == 20e9 and rows_bandwidth(table, 0.5) == 20e9  # below the first: the first
    assert rows_bandwidth(table, 2) == pytest.approx(14e9)  # halfway from 1 to 4 in log2
    assert rows_bandwidth(table, 8) == pytest.approx(7e9)  # halfway from 4 to 16
    assert rows_bandwidth(table, 64) == pytest.approx(6e9 * 16 / 64)  # past the last: its FLOP rate holds


def test_a_measured_kernel_pays_bytes_flops_and_fixed_cost_in_turn():
    """CPU decode attention: bytes / B + FLOPs / F + a fixed cost, not max(bytes / B, FLOPs / peak)."""
    from dataclasses import replace

    from kvwall.predict.step import CACHE, Op

    dev = replace(get_device("h100-sxm"), op_bandwidth={"attention": 10e9}, op_flops={"attention": 20e9},
                  op_fixed_s={"attention": 1e-4})
    roof = Roof(dev)
    op = Op("attention", 0, flops=4e6, cache_read=1e6, kernel="attention", kind=CACHE)
    assert roof.op_time(op) == pytest.approx(1e-4 + 4e6 / 20e9 + 1e6 / 10e9)  # 0.4 ms
    assert roof.bound(op) == "compute"  # 0.2 ms of arithmetic against 0.1 ms of bytes
    plain = Op("attention", 0, flops=4e6, cache_read=1e6, kernel="attention:int8", kind=CACHE)
    assert roof.op_time(plain) == pytest.approx(max(4e6 / roof.peak, 1e6 / 10e9))  # no rate: the roofline


def test_prefill_attention_runs_at_its_own_rate():
    """A prompt's attention (many queries: SDPA's causal GEMMs) is charged at the prefill kernel's FLOP rate,
    one decode token's at the decode kernel's: 64 causal queries of 32 heads x (128 + 128) at 100 GFLOP/s."""
    from dataclasses import replace

    dev = replace(get_device("h100-sxm"), op_bandwidth={"attention": 10e9},
                  op_flops={"attention": 20e9, "attention:prefill": 100e9})
    roof, spec = Roof(dev), load_spec("llama-2-7b")
    fm = Formats.for_spec(spec)
    prompt = next(o for o in step_ops(spec, Step(1, 0, 64), fm) if o.name == "attention")
    token = next(o for o in step_ops(spec, Step(1, 63, 1), fm) if o.name == "attention")
    assert (prompt.kernel, token.kernel) == ("attention:prefill", "attention")
    flops = 2 * 32 * 256 * (64 * 65 // 2)
    assert prompt.flops == flops
    assert roof.op_time(prompt) == pytest.approx(flops / 100e9 + prompt.bytes / 10e9)
    assert roof.op_time(token) == pytest.approx(2 * 32 * 256 * 64 / 20e9 + token.bytes / 10e9)


def test_prefill_attention_rate_by_prompt_tokens():
    """Measured at 128 and 2,048 prompt tokens (30 and 90 GFLOP/s), a 512-token prompt's attention runs at
    60 GFLOP/s (halfway in log2: 512 = 2^9 between 2^7 and 2^11), a 64-token one at the 128-token rate and an
    8k one at the 2,048-token rate; a chunk of 128 new tokens after 1,000 cached ones at the 128-token rate
    (its query rows); without the table, the one rate in op_flops."""
    from dataclasses import replace

    dev = replace(get_device("h100-sxm"), op_bandwidth={"attention": 10e9},
                  op_flops={"attention": 20e9, "attention:prefill": 100e9}, prefill_attention={128: 30e9, 2048: 90e9})
    roof, spec = Roof(dev), load_spec("llama-2-7b")
    fm = Formats.for_spec(spec)

    def attention(past, new):
        return next(o for o in step_ops(spec, Step(1, past, new), fm) if o.name == "attention")
    for past, new, rate in ((0, 512, 60e9), (0, 64, 30e9), (0, 8192, 90e9), (1000, 128, 30e9)):
        op = attention(past, new)
        assert op.rows == new
        assert roof.op_time(op) == pytest.approx(op.flops / rate + op.bytes / 10e9), (past, new)
    assert attention(63, 1).rows == 0  # a decode token: the decode kernel's one rate
    plain = Roof(replace(dev, prefill_attention={}))
    op = attention(0, 512)
    assert plain.op_time(op) == pytest.approx(op.flops / 100e9 + op.bytes / 10e9)


def test_a_matmul_streams_its_weights_at_its_rows_rate():
    from dataclasses import replace

    dev = replace(get_device("h100-sxm"), op_bandwidth={"matmul": 20e9}, matmul_rows={1: 20e9, 16: 5e9},
                  peak_flops={"bf16": 1e12})
    roof = Roof(dev)
    one, sixteen = (decode(TINY, 10, b, F16, roof) for b in (1, 16))
    mlp1 = next(o for o in one.ops if o.name == "mlp")
    mlp16 = next(o for o in sixteen.ops if o.name == "mlp")
    assert mlp1.rows == 1 and mlp16.rows == 16
    assert roof.op_time(mlp1) == pytest.approx(mlp1.bytes / 20e9)
    act = mlp16.bytes - mlp16.weight_bytes  # activations stream at the matrix-vector rate, weights at the 16-row one
    assert roof.op_time(mlp16) == pytest.approx(max(mlp16.flops / 1e12, mlp16.weight_bytes / 5e9 + act / 20e9))


def test_a_packed_matmul_streams_at_its_own_kernels_rate():
    """With the packed kernel's rates calibrated (packed_rows), an int4 model's projections stream at them and
    the LM head, 16-bit (no /HEAD format), at F.linear's; without them, at F.linear's rates too."""
    from dataclasses import replace

    from kvwall.predict.memory import Formats
    from kvwall.spec.formats import get_format

    base = replace(get_device("h100-sxm"), op_bandwidth={"matmul": 20e9}, matmul_rows={1: 20e9, 16: 5e9},
                   peak_flops={"bf16": 1e12})
    packed = replace(base, packed_rows={"matmul:int4": {1: 4e9, 16: 2e9}})
    int4 = Formats(get_format("int4"), F16.kv, F16.state)
    for dev, rate in ((packed, 4e9), (base, 20e9)):
        roof = Roof(dev)
        step = decode(TINY, 10, 1, int4, roof)
        mlp = next(o for o in step.ops if o.name == "mlp")
        head = next(o for o in step.ops if o.name == "lm_head")
        assert mlp.kernel == "matmul:int4" and head.kernel == ""
        act = mlp.bytes - mlp.weight_bytes
        assert roof.op_time(mlp) == pytest.approx(mlp.weight_bytes / rate + act / 20e9)
        assert roof.op_time(head) == pytest.approx(head.bytes / 20e9)


def test_a_packed_model_pays_its_kernels_fixed_costs():
    """A packed kernel's fixed cost per call (op_fixed_s) is added to each of its matmuls, and an attention block
    whose projections run it costs packed_overhead_s instead of the fp32 block's layer_overhead_s. Hand numbers:
    TINY's qkv_proj is 64 -> 128 (4 x 16 + 2 x 2 x 16); int4 g32 holds 64 x 128 / 2 = 4,096 code bytes +
    128 rows x 2 groups x (2 + 2) = 1,024 scale and zero bytes; its 1-row activations 1 x (64 + 128) x 2 B."""
    from dataclasses import replace

    base = replace(get_device("h100-sxm"), op_bandwidth={"matmul": 20e9}, matmul_rows={1: 20e9, 16: 5e9},
                   peak_flops={"bf16": 1e12}, layer_overhead_s=1e-3, step_overhead_s=5e-4)
    dev = replace(base, packed_rows={"matmul:int4": {1: 4e9, 16: 2e9}}, op_fixed_s={"matmul:int4": 2e-5},
                  packed_overhead_s={"matmul:int4": 3e-4})
    int4 = Formats(get_format("int4"), F16.kv, F16.state)
    step = decode(TINY, 10, 1, int4, Roof(dev))
    qkv = next(o for o in step.ops if o.name == "qkv_proj")
    assert qkv.weight_bytes == 5120 and qkv.bytes - qkv.weight_bytes == 384
    assert Roof(dev).op_time(qkv) == pytest.approx(2e-5 + 5120 / 4e9 + 384 / 20e9)
    assert step.overhead_s == pytest.approx(5e-4 + 3e-4)  # one attention block on the int4 path
    assert decode(TINY, 10, 1, F16, Roof(dev)).overhead_s == pytest.approx(5e-4 + 1e-3)  # fp16: F.linear's path
    int8 = Formats(get_format("int8"), F16.kv, F16.state)  # no int8 figure measured: the fp32 block's cost
    assert decode(TINY, 10, 1, int8, Roof(dev)).overhead_s == pytest.approx(5e-4 + 1e-3)


def test_a_step_the_engine_runs_layer_by_layer_pays_the_unfused_cost():
    """unfused_overhead_s is added per attention block to a step the engine does not run through its fused decode
    stack: a prefill (more than one token a row), or any step of a model whose layers are not all attention +
    gated MLP (Jamba: Mamba layers and MoE). Hand numbers: TINY is one attention + MLP block."""
    from dataclasses import replace

    dev = replace(get_device("h100-sxm"), layer_overhead_s=1e-3, step_overhead_s=5e-4, unfused_overhead_s=2e-4,
                  mixer_overhead_s={"mamba": 3e-3})
    assert decode(TINY, 10, 1, F16, Roof(dev)).overhead_s == pytest.approx(5e-4 + 1e-3)
    assert prefill(TINY, 8, 1, F16, Roof(dev)).overhead_s == pytest.approx(5e-4 + 1e-3 + 2e-4)
    packed = replace(dev, packed_overhead_s={"matmul:int4": 3e-4})
    int4 = Formats(get_format("int4"), F16.kv, F16.state)
    assert prefill(TINY, 8, 1, int4, Roof(packed)).overhead_s == pytest.approx(5e-4 + 3e-4 + 2e-4)
    jamba = load_spec("jamba-v0.1")
    kinds = [layer.mixer.kind for layer in jamba.layers]
    attention, mamba = kinds.count("attention"), kinds.count("mamba")
    assert attention == 4 and mamba == 28  # 1 : 7
    want = 5e-4 + attention * (1e-3 + 2e-4) + mamba * 3e-3
    assert decode(jamba, 10, 1, F16, Roof(dev)).overhead_s == pytest.approx(want)


def test_a_float_matmul_pays_the_fixed_cost_per_call_of_its_kernel():
    """A float matrix's op (kernel "") pays op_fixed_s["matmul"] per call on top of its bytes at the row rate
    (calibrate fits both through two matrix sizes); a packed matrix pays its own kernel's, and the attention
    over the cache pays neither. Hand numbers: TINY's fp16 qkv_proj is 64 x 128 x 2 B = 16,384 weight bytes,
    its activations 1 x (64 + 128) x 2 B = 384."""
    from dataclasses import replace

    dev = replace(get_device("h100-sxm"), op_bandwidth={"matmul": 20e9}, matmul_rows={1: 20e9, 16: 5e9},
                  op_fixed_s={"matmul": 4e-5, "matmul:int4": 2e-5})
    roof = Roof(dev)
    step = decode(TINY, 10, 1, F16, roof)
    qkv = next(o for o in step.ops if o.name == "qkv_proj")
    attention = next(o for o in step.ops if o.cache_read)
    assert qkv.weight_bytes == 16384 and qkv.bytes - qkv.weight_bytes == 384
    assert roof.op_time(qkv) == pytest.approx(4e-5 + 16384 / 20e9 + 384 / 20e9)
    no_fixed = Roof(replace(dev, op_fixed_s={}))
    assert roof.op_time(attention) == pytest.approx(no_fixed.op_time(attention))
    int4 = decode(TINY, 10, 1, Formats(get_format("int4"), F16.kv, F16.state), roof)
    packed = next(o for o in int4.ops if o.name == "qkv_proj")
    assert roof.op_time(packed) - no_fixed.op_time(packed) == pytest.approx(2e-5)
