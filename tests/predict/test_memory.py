"""The cache numbers of the source documents, by hand, and the predictor's invariants."""

import pytest
from hypothesis import given, settings, strategies as st

from kvwall.errors import KvwallError
from kvwall.predict.memory import Formats, Parallel, cache_bytes_per_token, memory, state_bytes
from kvwall.spec.formats import get_format
from kvwall.spec.model import MLP, Attention, LatentAttention, Layer, Mamba, Mamba2, ModelSpec
from kvwall.spec.resolve import load_spec

BF16, FP16 = get_format("bf16"), get_format("fp16")


@pytest.mark.parametrize("name, fmt, expected", [
    ("gpt2-xl", FP16, 2 * 48 * 25 * 64 * 2),          # 2 (K,V) x 48 layers x 25 heads x 64 dims x 2 B = 307,200
    ("llama-3-8b", BF16, 2 * 32 * 8 * 128 * 2),       # 131,072 = 128 KiB
    ("llama-3-70b", BF16, 2 * 80 * 8 * 128 * 2),      # 327,680 = 320 KiB
    ("deepseek-v3", BF16, (512 + 64) * 61 * 2),       # 70,272: one latent + rope key per layer
    ("jamba-v0.1", BF16, 2 * 4 * 8 * 128 * 2),        # 4 attention layers only
    ("nemotron-h-8b", BF16, 2 * 4 * 8 * 128 * 2),
])
def test_bytes_per_token(name, fmt, expected):
    assert cache_bytes_per_token(load_spec(name), fmt) == expected


def test_source_document_numbers():
    assert cache_bytes_per_token(load_spec("gpt2-xl"), FP16) == 307_200
    assert cache_bytes_per_token(load_spec("llama-3-8b"), BF16) == 131_072
    assert cache_bytes_per_token(load_spec("deepseek-v3"), BF16) == 70_272
    spec = load_spec("llama-3-70b")
    assert cache_bytes_per_token(spec, BF16) == 327_680
    mha = spec.with_kv_heads(64)
    assert cache_bytes_per_token(mha, BF16) == 2_621_440
    assert memory(mha, context=131_072, formats=Formats(BF16, BF16, BF16)).cache_bytes == 343_597_383_680


def test_mamba_state_by_hand_and_flat_in_context():
    spec = load_spec("mamba-2.8b")
    # 64 layers x d_inner 5120 x (d_conv 4 + d_state 16) x 2 B
    assert state_bytes(spec, BF16) == 64 * 5120 * (4 + 16) * 2
    sizes = {memory(spec, context=c).cache_bytes for c in (1, 4096, 1 << 20)}
    assert sizes == {64 * 5120 * 20 * 2}


def test_mamba2_state_by_hand():
    spec = load_spec("mamba2-2.7b")
    # conv (5120 + 2*128) x 4 + SSM 80 heads x 64 x 128, per layer, 64 layers, 2 B
    assert state_bytes(spec, BF16) == 64 * (5376 * 4 + 80 * 64 * 128) * 2


def test_gemma3_sliding_layers_stop_at_window():
    spec = load_spec("gemma-3-27b")
    per_layer = 2 * 16 * 128 * 2  # 8 KiB per token per layer

    def at(ctx):
        return memory(spec, context=ctx, formats=Formats(BF16, BF16, BF16)).cache_bytes

    assert at(1024) == 62 * 1024 * per_layer
    # past the window: 52 sliding layers hold 1024 tokens, 10 global layers hold everything
    assert at(131_072) == (52 * 1024 + 10 * 131_072) * per_layer
    assert at(131_073) - at(131_072) == 10 * per_layer


def test_paged_rounds_each_sequence_to_blocks():
    spec = load_spec("llama-3-8b")
    plain = memory(spec, batch=3, context=1000)
    paged = memory(spec, batch=3, context=1000, block_size=16)
    assert paged.cache_bytes == 3 * 1008 * 131_072  # 1000 rounded up to 63 blocks of 16
    assert paged.cache_used_bytes == plain.cache_bytes
    assert paged.cache_bytes - paged.cache_used_bytes == 3 * 8 * 131_072


def test_tp_splits_kv_heads_then_replicates():
    spec = load_spec("llama-3-8b")  # 8 KV heads
    one = memory(spec, context=1024)
    tp8 = memory(spec, context=1024, parallel=Parallel(tp=8))
    assert tp8.per_gpu()[1] == one.cache_bytes // 8
    llama70 = load_spec("llama-3-70b")  # 64 query heads, 8 KV heads: tp=16 replicates each KV head twice
    r16 = memory(llama70, context=1024, parallel=Parallel(tp=16))
    assert r16.per_gpu()[1] == memory(llama70, context=1024).cache_bytes // 8
    assert r16.cache_bytes == 2 * memory(llama70, context=1024).cache_bytes


def test_mla_latent_is_replicated_under_tp():
    spec = load_spec("deepseek-v3")
    one = memory(spec, context=4096)
    tp8 = memory(spec, context=4096, parallel=Parallel(tp=8))
    assert tp8.per_gpu()[1] == one.cache_bytes


def test_pipeline_stages_split_layers():
    spec = load_spec("llama-3-8b")
    rep = memory(spec, context=4096, parallel=Parallel(pp=4))
    assert [len(s) for s in rep.stages] == [8, 8, 8, 8]
    assert rep.per_gpu()[1] == memory(spec, context=4096).cache_bytes // 4


def test_per_gpu_token_bytes_are_the_busiest_stages():
    """Llama-3-8B's 32 layers over 5 stages: 7, 7, 6, 6, 6; the first (7 layers and the embedding) is the
    busiest, its GPU holding 7 x 8 KV heads x (128 + 128) x 2 B = 28,672 B a token, not all 32 layers'
    131,072 (as --json said before, 2026-12-04), and 4,096 tokens of them."""
    rep = memory(load_spec("llama-3-8b"), context=4096, parallel=Parallel(pp=5))
    assert [len(s) for s in rep.stages] == [7, 7, 6, 6, 6] and rep.busiest_stage() == 0
    assert rep.as_dict()["cache_bytes_per_token_per_gpu"] == 7 * 8 * 256 * 2 == 28_672
    assert rep.per_gpu()[1] == 28_672 * 4096


def test_weight_bytes_bf16_are_two_per_param():
    spec = load_spec("llama-3-8b")
    assert memory(spec).weight_bytes == 2 * 8_030_261_248


def test_bad_sizes():
    spec = load_spec("gpt2")
    with pytest.raises(KvwallError):
        memory(spec, batch=0)
    with pytest.raises(KvwallError):
        memory(spec, context=-1)
    with pytest.raises(KvwallError, match="does not divide"):
        memory(load_spec("llama-3-8b"), parallel=Parallel(tp=3))


# -- properties over random specs ----------------------------------------------

@st.composite
def specs(draw):
    hidden = draw(st.sampled_from([64, 128, 256]))
    layers = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["attn", "sliding", "mla", "mamba", "mamba2"]))
        if kind in ("attn", "sliding"):
            kv = draw(st.sampled_from([1, 2, 4]))
            mixer = Attention(4 * kv, kv, 32, 32, draw(st.integers(1, 512)) if kind == "sliding" else None)
        elif kind == "mla":
            mixer = LatentAttention(4, draw(st.sampled_from([32, 64])), None, 16, 8, 16)
        elif kind == "mamba":
            mixer = Mamba(2 * hidden, 16, 4, 8)
        else:
            mixer = Mamba2(hidden // 16, 32, 16, 1, 4)
        layers.append(Layer(mixer, MLP(2 * hidden), 2 * hidden))
    return ModelSpec("random", "test", hidden, 100, tuple(layers))


fmt_names = st.sampled_from(["bf16", "fp8", "int8", "int4", "int2", "nvfp4"])


@settings(max_examples=60, deadline=None)
@given(specs(), st.integers(1, 8), st.integers(1, 5000), fmt_names)
def test_cache_linear_in_batch(spec, batch, ctx, kv):
    fm = Formats(BF16, get_format(kv), BF16)
    one = memory(spec, batch=1, context=ctx, formats=fm).cache_bytes
    assert memory(spec, batch=batch, context=ctx, formats=fm).cache_bytes == batch * one


@settings(max_examples=60, deadline=None)
@given(specs(), st.integers(1, 5000), st.integers(1, 5000))
def test_cache_monotone_in_context_and_bounded_by_windows(spec, a, b):
    lo, hi = sorted((a, b))
    m_lo, m_hi = memory(spec, context=lo).cache_bytes, memory(spec, context=hi).cache_bytes
    assert m_lo <= m_hi
    growing = any(isinstance(layer.mixer, LatentAttention)
                  or (isinstance(layer.mixer, Attention) and not layer.mixer.window) for layer in spec.layers)
    if not growing:  # only SSM and sliding layers: nothing grows past the largest window
        cap = max([layer.mixer.window for layer in spec.layers if isinstance(layer.mixer, Attention)] + [1])
        assert memory(spec, context=max(hi, cap)).cache_bytes == memory(spec, context=cap).cache_bytes


@settings(max_examples=40, deadline=None)
@given(specs(), st.integers(1, 3000), st.sampled_from([1, 16, 128]))
def test_paging_never_saves_and_wastes_under_a_block(spec, ctx, block):
    paged = memory(spec, batch=2, context=ctx, block_size=block)
    assert 0 <= paged.cache_bytes - paged.cache_used_bytes
    per_token = sum(layer.token_bytes for layer in paged.layers)
    assert paged.cache_bytes - paged.cache_used_bytes <= 2 * (block - 1) * per_token
