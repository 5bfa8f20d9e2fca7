"""Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) and Qwen2-MoE's gated shared expert in the engine, against
transformers 5.25 on tiny random checkpoints, and the delta rule's chunked prefill against its plain loop."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_equivalence import (  # noqa: E402
    FP32,
    decode_logits,
    filled_cache,
    greedy_batch_alone_transformers,
    greedy_pair,
    save,
    verify_and_generate,
)
from tiny_checkpoints import COMMON, VOCAB, ids  # noqa: E402

from kvwall.engine.caches import ModelCache  # noqa: E402
from kvwall.engine.layers.gated_deltanet import (  # noqa: E402
    GatedDeltaNet,
    gated_delta_chunked,
    gated_delta_reference,
    gated_delta_step,
    gated_delta_step_,
    l2norm,
)
from kvwall.engine.layers.norm import GatedRMSNorm  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.predict.memory import memory  # noqa: E402

# 4 layers, layer_types linear x 3 then full (full_attention_interval 4); key heads 2 x 8, value heads 4 x 12
# (each key head serves 2 value heads), conv 4 taps; attention 4 q / 2 kv heads of 16, rotary on 4 of them (0.25)
LINEAR = dict(COMMON, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, tie_word_embeddings=False)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
GDN_FAMILIES = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"]
FAMILIES = [*GDN_FAMILIES, "qwen2_moe"]


def config(family: str):
    t = transformers
    return {  # qwen3_next: a dense MLP on layer 0 (mlp_only_layers), MoE with a gated shared expert elsewhere
        "qwen3_next": lambda: t.Qwen3NextConfig(**LINEAR, **EXPERTS, mlp_only_layers=[0]),
        "qwen3_5_text": lambda: t.Qwen3_5TextConfig(**LINEAR),
        "qwen3_5_moe_text": lambda: t.Qwen3_5MoeTextConfig(**LINEAR, **EXPERTS),
        # softmax top-2 weights not renormalised (norm_topk_prob false), MoE on odd layers only (step 2)
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**COMMON, **EXPERTS, decoder_sparse_step=2, tie_word_embeddings=False),
    }[family]()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(family) -> (path, transformers model, engine model), built once per module."""
    out = {}

    def get(family):
        if family not in out:
            path = tmp_path_factory.mktemp(family)
            out[family] = (path, save(config(family), path), load_model(path))
        return out[family]

    return get


# -- the delta rule itself: chunked prefill and decode step against the plain loop and transformers' functions ---

def rule_inputs(B=2, T=150, H=4, dk=8, dv=12, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, dk, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=g, dtype=dtype)
    decay = -2 * torch.rand(B, T, H, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    return q, k, v, decay, beta, torch.randn(B, H, dk, dv, generator=g, dtype=dtype)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_rule_equals_the_plain_loop_in_float64(chunk):
    q, k, v, g, beta, S = rule_inputs()
    q, k = l2norm(q) * 8 ** -0.5, l2norm(k)
    o_ref, S_ref = gated_delta_reference(q, k, v, g, beta, S)
    o, S_end = gated_delta_chunked(q, k, v, g, beta, S, chunk=chunk)
    assert (o - o_ref).abs().max().item() < 1e-12 and (S_end - S_ref).abs().max().item() < 1e-12


@pytest.mark.slow
def test_rule_equals_transformers_chunked_and_recurrent_functions():
    """transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (fp32, l2norm inside) on
    the same inputs; ours in float64 on the raw inputs normalised as they are."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, S = rule_inputs(T=100)
    o, S_end = gated_delta_reference(l2norm(q) * 8 ** -0.5, l2norm(k), v, g, beta, S)
    f = lambda t: t.float()  # noqa: E731
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        o_hf, S_hf = fn(f(q), f(k), f(v), f(g), f(beta), initial_state=f(S), output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        assert (o_hf.double() - o).abs().max().item() < 1e-5 and (S_hf.double() - S_end).abs().max().item() < 1e-5


def test_delta_rule_overwrites_a_key_where_a_linear_state_adds():
    """The delta rule's point: writing v2 under a key that holds v1 with beta = 1 replaces it (reads back v2),
    where a plain sum k (x) v would read back v1 + v2. No decay (g = 0); one head, k a unit vector."""
    k = torch.tensor([[[1.0, 0.0]]])  # (B, H, dk)
    v1, v2 = torch.tensor([[[3.0, -1.0]]]), torch.tensor([[[0.5, 2.0]]])  # (B, H, dv)
    zero, one = torch.zeros(1, 1), torch.ones(1, 1)
    _, S = gated_delta_step(k, k, v1, zero, one, torch.zeros(1, 1, 2, 2))
    out, S = gated_delta_step(k, k, v2, zero, one, S)
    assert torch.allclose(out, v2)  # not v1 + v2 = (3.5, 1.0)
    half, _ = gated_delta_step(k, k, v2, zero, one / 2, gated_delta_step(k, k, v1, zero, one, S * 0)[1])
    assert torch.allclose(half, (v1 + v2) / 2)  # beta = 0.5: halfway from the old value to the new


def test_in_place_step_equals_the_reference_step():
    q, k, v, g, beta, S = rule_inputs(T=1, dtype=torch.float32)
    q, k = l2norm(q[:, 0]), l2norm(k[:, 0])
    o_ref, S_ref = gated_delta_step(q, k, v[:, 0], g[:, 0], beta[:, 0], S)
    o = gated_delta_step_(q, k, v[:, 0], g[:, 0], beta[:, 0], S)  # S updated in place
    assert (o - o_ref).abs().max().item() < 1e-6 and (S - S_ref).abs().max().item() < 1e-6


def test_padding_leaves_the_state_as_after_the_last_real_token():
    q, k, v, g, beta, S = rule_inputs(T=70, dtype=torch.float32)
    q, k = l2norm(q), l2norm(k)
    g[1, 40:], beta[1, 40:] = 0.0, 0.0  # how the layer marks right padding
    _, S_full = gated_delta_chunked(q, k, v, g, beta, S, chunk=16)
    _, S_40 = gated_delta_reference(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], S)
    assert (S_full[1] - S_40[1]).abs().max().item() < 1e-5


def test_gated_norm_normalises_each_head_then_gates():
    norm = GatedRMSNorm(4, 4, eps=0.0, before_gate=True, cast_first=True)
    y = torch.tensor([[[3.0, 3.0, 3.0, 3.0], [-0.5, 0.5, -0.5, 0.5]]])  # (1, 2 heads, 4)
    z = torch.full((1, 2, 4), 50.0)  # silu(50) = 50
    assert torch.allclose(norm(y, z), 50 * torch.tensor([[[1.0] * 4, [-1.0, 1.0, -1.0, 1.0]]]), atol=1e-4)


# -- the models against transformers ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_equals_transformers(family, made):
    _, ref, model = made(family)
    x = ids(length=48)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_prefill_across_several_chunks_equals_transformers(family, made):
    """150 tokens: three chunks of 64 in both. fp32 in another order: within 5e-5 of the largest logit (the
    rule alone agrees to 1e-12 in float64, test_chunked_rule_equals_the_plain_loop_in_float64)."""
    _, ref, model = made(family)
    x = ids(length=150)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert (got - expected).abs().max().item() < 5e-5 * expected.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["contiguous", "sliding", "paged"])
def test_decode_step_by_step_equals_one_full_forward(family, cache, made):
    """Prefill 5, a chunk of 7 on top of the state, then one token at a time: each step's logits equal the full
    pass's. In fp32 the chunked rule (a triangular solve) and the step round differently: within 5e-5 of the
    largest logit (1.6e-4 of 6.3 seen on qwen3_next); in float64 the two agree to 1e-12."""
    path, _, model = made(family)
    x = ids(length=40)

    def both(model, dtype):
        with torch.no_grad():
            full = model(x)
        return decode_logits(model, x, cache, dtype), full

    steps, full = both(model, torch.float32)
    assert (steps - full).abs().max().item() < 5e-5 * max(1.0, full.abs().max().item())
    if cache == "contiguous":
        steps, full = both(load_model(path).set_eager(True).double(), torch.float64)
        assert (steps - full).abs().max().item() < 1e-12 * max(1.0, full.abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_20_tokens_equal_transformers_generate(family, made):
    _, ref, model = made(family)
    got, expected = greedy_pair(model, ref)
    assert len(set(expected)) > 1, "a degenerate reference would prove little"
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_3_different_lengths_equals_one_by_one(family, made):
    """Right-padded rows: padding writes nothing into a row's conv or delta-rule state."""
    _, ref, model = made(family)
    batch, alone, _ = greedy_batch_alone_transformers(model, ref)
    assert batch == alone


# -- the state: its bytes, its layout, the fused decode stack ---------------------------------------------------

@pytest.mark.slow
def test_state_bytes_equal_the_predictor_and_the_hand_count(made):
    """Per sequence, fp32: layers 0-2 Gated DeltaNet, conv (2·2·8 + 4·12 = 80 channels) x 4 taps + 4 value heads
    x 8 x 12; layer 3 attention, K and V of 2 heads x 16 per token. After 16 and after 300 tokens."""
    model = made("qwen3_next")[2]
    state = 3 * (80 * 4 + 4 * 8 * 12) * 4
    per_token = 2 * 2 * 16 * 4
    B = 2
    for length in (16, 300):
        cache = filled_cache(model, B, length)
        assert isinstance(cache, ModelCache)
        assert cache.state.nbytes() == B * state
        assert cache.nbytes() == memory(model.spec, batch=B, context=length, formats=FP32).cache_bytes \
            == B * (state + per_token * length)


@pytest.mark.slow
def test_qwen3_next_and_qwen3_5_layouts_load_the_same_layer(made):
    """Qwen3-Next stores [q k v z] and [b a] grouped per key head; Qwen3.5 q|k|v, z, b, a apart. The same
    transformers weights, reordered as Qwen3.5 stores them, give the same layer output."""
    _, ref, model = made("qwen3_next")
    hf = ref.model.layers[0].linear_attn
    me = model.layers[0].mixer
    assert isinstance(me, GatedDeltaNet) and me.interleaved
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        q, k, v, z, b, a = hf.fix_query_key_value_ordering(hf.in_proj_qkvz(x), hf.in_proj_ba(x))
        flat = lambda t: t.reshape(2, 9, -1)  # noqa: E731
        expected = torch.cat([flat(q), flat(k), flat(v), flat(z), flat(b), flat(a)], -1)
        qkv, z2, b2, a2 = me.split(me.in_proj(x))
    assert torch.allclose(torch.cat([qkv, flat(z2), b2, a2], -1), expected, atol=1e-6)


@pytest.mark.slow
def test_fused_decode_stack_steps_aside(made):
    """The C++ decode stack has no delta rule, no output gate and no gated shared expert: these models decode
    layer by layer (DecodeStack.build gives None), and the step still equals the full pass above."""
    from kvwall.engine.decode_stack import DecodeStack

    for family in FAMILIES:
        assert DecodeStack.build(made(family)[2]) is None


# -- the CLI ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_verify_and_generate_on_qwen3_next(made, capsys):
    path, _, model = made("qwen3_next")
    verify_and_generate(path, model.spec, capsys)


def test_qwen3_5_moe_always_renormalises_its_top_k():
    """transformers' Qwen3_5MoeTopKRouter divides the top-k weights by their sum whatever the config says;
    Qwen3-Next's follows norm_topk_prob."""
    from kvwall.spec.hf import spec_from_config

    base = dict(LINEAR, **EXPERTS, vocab_size=VOCAB, norm_topk_prob=False)
    moe = lambda mt: spec_from_config(dict(base, model_type=mt)).layers[0].ffn  # noqa: E731
    assert moe("qwen3_5_moe_text").routing.normalize and not moe("qwen3_next").routing.normalize
