"""Kimi Linear in the engine: Kimi Delta Attention beside NoPE MLA layers, a sigmoid group-limited MoE with a shared
expert, against transformers 5.25 on a tiny random checkpoint, and the KDA rule against transformers' own torch
functions (chunk_kimi_delta_attention, recurrent_kimi_delta_attention) and its plain loop."""

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
    made as made_checkpoint,
    verify_and_generate,
)
from tiny_checkpoints import COMMON, ids  # noqa: E402

from kvwall.engine.caches import ModelCache  # noqa: E402
from kvwall.engine.layers.gated_deltanet import gated_delta_decode_, l2norm  # noqa: E402
from kvwall.engine.layers.kda import KimiDeltaAttention, kda_chunked, kda_reference, kda_step  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.predict.memory import memory  # noqa: E402

# 4 layers: KDA, KDA, MLA, KDA (kda_layers / full_attn_layers are 1-based); KDA 4 heads x 16, conv 4 taps; MLA 4
# heads, latent 32, nope 16 + (unrotated) rope part 8, v 16; layer 0 a dense MLP, the rest 8 experts in 4 groups
# (top-2 groups, top-2 experts, sigmoid scores + correction bias) and one shared expert of 32
KIMI = dict(COMMON, num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None, num_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
            tie_word_embeddings=False,
            linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                                "full_attn_layers": [3]})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(path, transformers model, engine model), built once per module."""
    return made_checkpoint(tmp_path_factory, "kimi_linear", transformers.KimiLinearConfig(**KIMI))


# -- the KDA rule ---------------------------------------------------------------------------------------------

def rule_inputs(B=2, T=150, H=3, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=g, dtype=dtype) for _ in range(3))
    decay = -2 * torch.rand(B, T, H, d, generator=g, dtype=dtype)  # a different log decay per key channel
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    return q, k, v, decay, beta, torch.randn(B, H, d, d, generator=g, dtype=dtype)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_rule_equals_the_plain_loop_in_float64(chunk):
    q, k, v, g, beta, S = rule_inputs()
    q, k = l2norm(q) * 8 ** -0.5, l2norm(k)
    o_ref, S_ref = kda_reference(q, k, v, g, beta, S)
    o, S_end = kda_chunked(q, k, v, g, beta, S, chunk=chunk)
    assert (o - o_ref).abs().max().item() < 1e-12 and (S_end - S_ref).abs().max().item() < 1e-12


@pytest.mark.slow
def test_rule_equals_transformers_chunked_and_recurrent_functions():
    """transformers' torch reference functions (fp32, l2norm and the d^-½ scale inside) on the same inputs; ours
    in float64 on the inputs normalised as they are."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta, S = rule_inputs(T=100)
    o, S_end = kda_reference(l2norm(q) * 8 ** -0.5, l2norm(k), v, g, beta, S)
    f = lambda t: t.float()  # noqa: E731
    for fn in (hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention):
        o_hf, S_hf = fn(f(q), f(k), f(v), f(g), f(beta), initial_state=f(S), output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        assert (o_hf.double() - o).abs().max().item() < 1e-5 and (S_hf.double() - S_end).abs().max().item() < 1e-5


def test_decay_is_per_key_channel():
    """Two keys e0, e1 written (β = 1) with values v0, v1; then a step whose gate wipes key channel 0 (log decay
    -50) and keeps channel 1 (0), writing nothing (β = 0): q = e0 reads ~0, q = e1 still reads v1. A per-head
    scalar decay (Gated DeltaNet) could not keep one and drop the other."""
    e0, e1 = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.0, 1.0]]])  # (B, H, d)
    v0, v1 = torch.tensor([[[3.0, -1.0]]]), torch.tensor([[[0.5, 2.0]]])
    keep, one, zero = torch.zeros(1, 1, 2), torch.ones(1, 1), torch.zeros(1, 1)
    _, S = kda_step(e0, e0, v0, keep, one, torch.zeros(1, 1, 2, 2))
    _, S = kda_step(e1, e1, v1, keep, one, S)
    wipe0 = torch.tensor([[[-50.0, 0.0]]])
    read0, S2 = kda_step(e0, e0, v0, wipe0, zero, S)
    read1, _ = kda_step(e1, e1, v1, wipe0, zero, S)
    assert read0.abs().max().item() < 1e-20 and torch.allclose(read1, v1)
    assert torch.allclose(S2[0, 0, 1], v1[0, 0]) and S2[0, 0, 0].abs().max().item() < 1e-20


def test_in_place_step_equals_the_reference_step():
    """The decode fast path (the C++ kernel where built, else the torch in-place step) with a per-channel decay."""
    q, k, v, g, beta, S = rule_inputs(T=1, dtype=torch.float32)
    q, k = l2norm(q[:, 0]), l2norm(k[:, 0])
    o_ref, S_ref = kda_step(q, k, v[:, 0], g[:, 0], beta[:, 0], S)
    o = gated_delta_decode_(q, k, v[:, 0], g[:, 0], beta[:, 0], S)  # S updated in place
    assert (o - o_ref).abs().max().item() < 1e-6 and (S - S_ref).abs().max().item() < 1e-6


def test_padding_leaves_the_state_as_after_the_last_real_token():
    q, k, v, g, beta, S = rule_inputs(T=70, dtype=torch.float32)
    q, k = l2norm(q), l2norm(k)
    g[1, 40:], beta[1, 40:] = 0.0, 0.0  # how the layer marks right padding
    _, S_full = kda_chunked(q, k, v, g, beta, S, chunk=16)
    _, S_40 = kda_reference(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], S)
    assert (S_full[1] - S_40[1]).abs().max().item() < 1e-5


# -- the model against transformers ---------------------------------------------------------------------------

def test_full_forward_equals_transformers(made):
    """The fast equivalence test: 2 x 24 tokens (part of one chunk of 64; several chunks below)."""
    _, ref, model = made
    assert [type(layer.mixer).__name__ for layer in model.layers] == ["KimiDeltaAttention"] * 2 + [
        "LatentAttention", "KimiDeltaAttention"]
    assert model.rope_keys == []  # NoPE: the MLA layer rotates nothing, and no rotary table is built
    x = ids(length=24)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-4


@pytest.mark.slow
def test_prefill_across_several_chunks_equals_transformers(made):
    """150 tokens: three chunks of 64 in both. fp32 in another order: within 5e-5 of the largest logit."""
    _, ref, model = made
    x = ids(length=150)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert (got - expected).abs().max().item() < 5e-5 * expected.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_decode_step_by_step_equals_one_full_forward(cache, made):
    """Prefill 5, a chunk of 7 on top of the state, then one token at a time: each step's logits equal the full
    pass's, within 5e-5 of the largest logit in fp32. In float64 the outputs of the KDA mixers of layers 0 and 1
    agree to 1e-12; later ones and the logits do not, by design: the MoE router (layer 1's channel mixer) and the
    MLA softmax run in fp32 whatever the model's dtype (engine/layers/moe.py, latent.py; 2e-8 seen)."""
    path, _, model = made
    x = ids(length=40)

    def both(model, dtype):
        seen = {}
        hooks = [model.layers[i].mixer.register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, []).append(out))
                 for i in (0, 1)]
        with torch.no_grad():
            full = model(x)
            kda_full = [seen.pop(i)[0] for i in (0, 1)]
        steps = decode_logits(model, x, cache, dtype)
        for h in hooks:
            h.remove()
        kda_gap = max((torch.cat(seen[i], 1) - kda_full[i]).abs().max().item() for i in (0, 1))
        return steps, full, kda_gap

    steps, full, _ = both(model, torch.float32)
    assert (steps - full).abs().max().item() < 5e-5 * max(1.0, full.abs().max().item())
    if cache == "contiguous":
        _, _, kda_gap = both(load_model(path).set_eager(True).double(), torch.float64)
        assert kda_gap < 1e-12


@pytest.mark.slow
def test_greedy_20_tokens_equal_transformers_generate(made):
    _, ref, model = made
    got, expected = greedy_pair(model, ref)
    assert len(set(expected)) > 1, "a degenerate reference would prove little"
    assert got == expected


@pytest.mark.slow
def test_batch_of_3_different_lengths_equals_one_by_one_and_transformers(made):
    """Right-padded rows: padding writes nothing into a row's conv or KDA state, nor the MLA latent cache. Each row
    alone is also transformers' own greedy continuation."""
    _, ref, model = made
    batch, alone, expected = greedy_batch_alone_transformers(model, ref)
    assert batch == alone
    assert alone == expected


# -- the state: its bytes, the fused decode stack, the CLI ------------------------------------------------------

@pytest.mark.slow
def test_state_bytes_equal_the_predictor_and_the_hand_count(made):
    """Per sequence, fp32: three KDA layers, conv (3 x 4 heads x 16 = 192 channels) x 4 taps + 4 heads x 16 x 16;
    one MLA layer, latent 32 + shared key 8 per token. After 16 and after 100 tokens."""
    model = made[2]
    state = 3 * (192 * 4 + 4 * 16 * 16) * 4
    per_token = (32 + 8) * 4
    B = 2
    for length in (16, 100):
        cache = filled_cache(model, B, length)
        assert isinstance(cache, ModelCache)
        assert cache.state.nbytes() == B * state
        assert cache.nbytes() == memory(model.spec, batch=B, context=length, formats=FP32).cache_bytes \
            == B * (state + per_token * length)


def test_fused_decode_stack_steps_aside(made):
    """The C++ decode stack has no KDA: the model decodes layer by layer (DecodeStack.build gives None)."""
    from kvwall.engine.decode_stack import DecodeStack

    assert isinstance(made[2].layers[0].mixer, KimiDeltaAttention) and DecodeStack.build(made[2]) is None


@pytest.mark.slow
def test_verify_and_generate(made, capsys):
    verify_and_generate(made[0], made[2].spec, capsys)
