"""MiniMax in the engine: lightning attention beside softmax GQA layers, a softmax top-2 MoE, and MiniMax's post-norm
residual with its alpha/beta factors, against transformers 5.25 on a tiny random checkpoint; the lightning rule
against its plain loop and hand-computed sums."""

from __future__ import annotations

import math

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
    save,
    verify_and_generate,
)
from tiny_checkpoints import COMMON, ids  # noqa: E402

from kvwall.engine.caches import ModelCache, make_cache  # noqa: E402
from kvwall.engine.layers.lightning import (  # noqa: E402
    Lightning,
    lightning_chunked,
    lightning_reference,
    lightning_step,
    lightning_step_,
    slopes,
)
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.predict.memory import memory  # noqa: E402

# 4 layers: softmax, lightning, softmax, lightning (transformers' default pattern); 4 heads of 16 (softmax: 2 KV
# heads); 4 experts top-2; transformers' prefill blocks of 16 (so 40+ tokens cross blocks). The residual factors
# are MiniMax-Text-01's alpha 3.5565588200778455 (catalog/models/minimax-text-01.json) on the attention sides and
# other values elsewhere, so that each of the six is seen.
MINIMAX = dict(COMMON, num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=16,
               full_attn_alpha_factor=3.5565588200778455, full_attn_beta_factor=1.0,
               linear_attn_alpha_factor=3.5565588200778455, linear_attn_beta_factor=0.7, mlp_alpha_factor=2.0,
               mlp_beta_factor=1.3, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(path, transformers model, engine model), built once per module."""
    return made_checkpoint(tmp_path_factory, "minimax", transformers.MiniMaxConfig(**MINIMAX))


# -- the lightning rule ---------------------------------------------------------------------------------------

def rule_inputs(B=2, T=150, H=3, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=g, dtype=dtype) for _ in range(3))
    rate = torch.tensor([0.5, 0.05, 1e-5], dtype=dtype)  # (H,): fast, slow and almost no forgetting
    return q, k, v, (-rate).expand(B, T, H).clone(), torch.randn(B, H, d, d, generator=g, dtype=dtype)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_rule_equals_the_plain_loop_in_float64(chunk):
    q, k, v, g, S = rule_inputs()
    o_ref, S_ref = lightning_reference(q, k, v, g, S)
    o, S_end = lightning_chunked(q, k, v, g, S, chunk=chunk)
    assert (o - o_ref).abs().max().item() < 1e-11 and (S_end - S_ref).abs().max().item() < 1e-11


def test_one_channel_is_a_geometric_sum():
    """H = d = 1, q = k = v = 1 from a zero state: o_t = Σ_{j<=t} exp(-s (t - j)) = (1 - r^(t+1)) / (1 - r),
    r = exp(-s); s = 0.5, t = 0..4."""
    T, s = 5, 0.5
    ones = torch.ones(1, T, 1, 1, dtype=torch.float64)
    o, _ = lightning_chunked(ones, ones, ones, torch.full((1, T, 1), -s, dtype=torch.float64),
                             torch.zeros(1, 1, 1, 1, dtype=torch.float64), chunk=2)
    r = math.exp(-s)
    assert o.flatten().tolist() == pytest.approx([(1 - r ** (t + 1)) / (1 - r) for t in range(T)], rel=1e-12)


def test_slopes_are_alibi_rates_scaled_by_depth():
    """8 heads: base 2^(-8/8) = 1/2, so layer 0's rates are 1/2, 1/4, ... (times 1 + 1e-5); the last of 4 layers
    scales them by 1 - 3 / (3 + 1e-5) + 1e-5 = 1.3333e-5."""
    first, last = slopes(8, 0, 4), slopes(8, 3, 4)
    assert first.tolist() == pytest.approx([0.5 ** (h + 1) * (1 + 1e-5) for h in range(8)], rel=1e-6)
    assert last.tolist() == pytest.approx([0.5 ** (h + 1) * (1 - 3 / (3 + 1e-5) + 1e-5) for h in range(8)], rel=1e-4)


def test_in_place_step_equals_the_reference_step():
    q, k, v, g, S = rule_inputs(T=1, dtype=torch.float32)
    o_ref, S_ref = lightning_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], S)
    o = lightning_step_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], S)  # S updated in place
    assert (o - o_ref).abs().max().item() < 1e-5 and (S - S_ref).abs().max().item() < 1e-6


def test_padding_leaves_the_state_as_after_the_last_real_token():
    q, k, v, g, S = rule_inputs(T=70)
    g[1, 40:], k[1, 40:], v[1, 40:] = 0.0, 0.0, 0.0  # how the layer marks right padding
    _, S_full = lightning_chunked(q, k, v, g, S, chunk=16)
    _, S_40 = lightning_reference(q[:, :40], k[:, :40], v[:, :40], g[:, :40], S)
    assert (S_full[1] - S_40[1]).abs().max().item() < 1e-12


# -- the model against transformers ---------------------------------------------------------------------------

def test_full_forward_equals_transformers(made):
    """The fast equivalence test: 2 x 40 tokens, past transformers' block of 16; the slopes equal the buffers
    transformers saved (which the engine does not read)."""
    _, ref, model = made
    assert [type(layer.mixer).__name__ for layer in model.layers] == ["Attention", "Lightning"] * 2
    for i in (1, 3):
        assert torch.equal(model.layers[i].mixer.rate, ref.model.layers[i].self_attn.slope_rate.flatten())
    assert model.spec.layers[1].alpha_beta == (3.5565588200778455, 0.7, 2.0, 1.3)
    x = ids(length=40)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()


@pytest.mark.slow
def test_prefill_across_several_blocks_equals_transformers(made):
    """150 tokens: ten blocks of 16 in transformers, three of 64 here."""
    _, ref, model = made
    x = ids(length=150)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()


@pytest.mark.slow
def test_sliding_window_on_the_softmax_layers_equals_transformers(tmp_path):
    """sliding_window 8 windows the softmax layers (transformers' mask); 40 tokens, well past it, full forward and
    decoding through the sliding cache (a ring of 8 slots on those layers)."""
    ref = save(transformers.MiniMaxConfig(**MINIMAX, sliding_window=8), tmp_path)
    model = load_model(tmp_path)
    assert model.spec.layers[0].mixer.window == 8
    x = ids(length=40)
    B, T = x.shape
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
        c = make_cache("sliding", model.spec, B, T)
        steps = torch.cat([model(x[:, :5], None, c)] + [model(x[:, t:t + 1], torch.full((B, 1), t), c)
                                                         for t in range(5, T)], 1)
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()
    assert (steps - got).abs().max().item() < 5e-5 * got.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["contiguous", "sliding", "paged", "int8"])
def test_decode_step_by_step_equals_one_full_forward(cache, made):
    """Prefill 5, a chunk of 7 on top of the state, then one token at a time: each step's logits equal the full
    pass's (int8 K/V on the softmax layers: within its quantization error). In float64 the lightning mixers of
    layers 1 and 3 agree to 1e-12 between the two; the logits do not, by design: the MoE router runs in fp32
    whatever the model's dtype (engine/layers/moe.py)."""
    path, _, model = made
    x = ids(length=40)

    def both(model, dtype):
        seen = {}
        hooks = [model.layers[i].mixer.register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, []).append(out))
                 for i in (1,)]
        with torch.no_grad():
            full = model(x)
            mixer_full = seen.pop(1)[0]
        steps = decode_logits(model, x, cache, dtype, residual=8)
        for h in hooks:
            h.remove()
        return steps, full, (torch.cat(seen[1], 1) - mixer_full).abs().max().item()

    steps, full, _ = both(model, torch.float32)
    tol = 5e-2 if cache == "int8" else 5e-5
    assert (steps - full).abs().max().item() < tol * max(1.0, full.abs().max().item())
    if cache == "contiguous":
        _, _, gap = both(load_model(path).set_eager(True).double(), torch.float64)
        assert gap < 1e-12


@pytest.mark.slow
def test_greedy_20_tokens_equal_transformers_generate(made):
    _, ref, model = made
    got, expected = greedy_pair(model, ref)
    assert len(set(expected)) > 1, "a degenerate reference would prove little"
    assert got == expected


@pytest.mark.slow
def test_batch_of_3_different_lengths_equals_one_by_one_and_transformers(made):
    """Right-padded rows: padding neither decays nor writes a row's lightning state. Each row alone is also
    transformers' own greedy continuation."""
    _, ref, model = made
    batch, alone, expected = greedy_batch_alone_transformers(model, ref)
    assert batch == alone
    assert alone == expected


# -- the state: its bytes, the fused decode stack, the CLI ------------------------------------------------------

@pytest.mark.slow
def test_state_bytes_equal_the_predictor_and_the_hand_count(made):
    """Per sequence, fp32: two lightning layers of 4 heads x 16 x 16 (no conv state); two softmax layers, K and V
    of 2 heads x 16 per token. After 16 and after 100 tokens."""
    model = made[2]
    state = 2 * 4 * 16 * 16 * 4
    per_token = 2 * 2 * 2 * 16 * 4
    B = 2
    for length in (16, 100):
        cache = filled_cache(model, B, length)
        assert isinstance(cache, ModelCache)
        assert cache.state.nbytes() == B * state
        assert cache.nbytes() == memory(model.spec, batch=B, context=length, formats=FP32).cache_bytes \
            == B * (state + per_token * length)


def test_fused_decode_stack_steps_aside(made):
    """The C++ decode stack has no lightning attention and no post-norm residual: layer by layer."""
    from kvwall.engine.decode_stack import DecodeStack

    assert isinstance(made[2].layers[1].mixer, Lightning) and DecodeStack.build(made[2]) is None


@pytest.mark.slow
def test_verify_and_generate(made, capsys):
    verify_and_generate(made[0], made[2].spec, capsys)


def test_residual_factors_are_read_in_either_spelling():
    """MiniMax-Text-01's catalog config (transformers' spelling): alpha 3.5565588200778455, beta 1.0 on every side;
    the remote code's layernorm_*_alpha/beta names give the same fields; absent ones are 1 (transformers' default).
    Parameter counts do not change (the factors are not weights)."""
    import json as _json
    from importlib import resources

    from kvwall.spec.hf import spec_from_config

    data = _json.loads((resources.files("kvwall.catalog") / "models" / "minimax-text-01.json").read_text())
    spec = spec_from_config(data)
    a = 3.5565588200778455
    assert {layer.alpha_beta for layer in spec.layers} == {(a, 1.0, a, 1.0)}
    remote = {k: v for k, v in data.items() if not k.endswith("_factor")}
    remote.update(layernorm_linear_attention_beta=0.5, layernorm_mlp_alpha=2.5)
    spec2 = spec_from_config(remote)
    kinds = {layer.mixer.kind: layer.alpha_beta for layer in spec2.layers}
    assert kinds == {"lightning": (1.0, 0.5, 2.5, 1.0), "attention": (1.0, 1.0, 2.5, 1.0)}
    assert spec2.params() == spec.params()
