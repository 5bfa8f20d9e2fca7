"""Granite 4.0 hybrids (granitemoehybrid) in the engine (issue #42): Mamba-2 and attention layers, routed experts
plus a shared MLP, and Granite's muP multipliers, against transformers 5.25 on tiny random checkpoints."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_equivalence import (  # noqa: E402
    TINY,
    TOLERANCE,
    catalog_params,
    decode_error,
    full_forward_error,
    greedy_pairs,
    save,
)

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.engine.model import Transformer  # noqa: E402

# Mamba-2 (8 heads x 16, 2 groups of state 16, conv 4), attention, Mamba-2; multipliers far from 1 so that each
# one missing or misplaced moves the logits well past the tolerance
GRANITE = dict(TINY, intermediate_size=32, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
               shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
               mamba_chunk_size=16, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
               logits_scaling=4.0)
VARIANTS = {
    "moe_rope": dict(GRANITE, num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope"),
    "dense_nope": dict(GRANITE, num_local_experts=0),  # the shared MLP alone; attention without positions (4.0-H)
}


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    made = {}

    def get(variant):
        if variant not in made:
            path = tmp_path_factory.mktemp(variant)
            made[variant] = (path, save(transformers.GraniteMoeHybridConfig(**VARIANTS[variant]), path))
        return made[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_forward_and_decode_equal_transformers(granite, variant):
    path, ref = granite(variant)
    assert full_forward_error(path, ref) < TOLERANCE
    assert decode_error(path, length=20) < TOLERANCE  # past the 16-token scan chunk


def test_multipliers_come_from_the_config(granite):
    spec = load_model(granite("moe_rope")[0]).spec
    assert (spec.embed_scale, spec.residual_scale, spec.logit_scale) == (3.0, 0.5, 0.25)
    assert spec.layers[1].mixer.scale == 0.1  # attention_multiplier is the softmax scale


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_20_tokens_equal_transformers_at_batch_1_and_3(granite, variant):
    path, ref = granite(variant)
    for lengths in [(12,), (3, 21, 9)]:  # batch 3: right-padded prompts of different lengths
        pairs = greedy_pairs(path, ref, lengths)
        assert all(len(set(want)) > 1 for _, want in pairs), "a degenerate reference would prove little"
        assert [got for got, _ in pairs] == [want for _, want in pairs]


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["paged", "int8"])
def test_decode_with_other_caches_equals_full_forward(granite, cache):
    assert decode_error(granite("moe_rope")[0], cache) < TOLERANCE


def test_state_and_kv_bytes_by_hand(granite):
    """Per sequence, fp32: Mamba-2 layers 0 and 2 keep conv (128 + 2 x 2 x 16 = 192 channels x 4) and SSM state
    (8 heads x 16 x 16): (768 + 2048) x 4 B each; attention layer 1 keeps K and V of 2 heads x 16 per token."""
    model = load_model(granite("moe_rope")[0])
    B, T = 2, 30
    cache = make_cache("contiguous", model.spec, B, T)
    assert cache.state.nbytes() == B * 2 * (192 * 4 + 8 * 16 * 16) * 4
    assert cache.kv.nbytes() == B * T * 2 * 2 * 16 * 4


def test_residual_multiplier_keeps_the_fused_decode_stack_out():
    """The C++ decode stack adds each branch to the residual unscaled: a model with a residual multiplier must run
    layer by layer (here every layer is attention + the shared MLP, which the stack would otherwise take)."""
    cfg = transformers.GraniteMoeHybridConfig(**dict(VARIANTS["dense_nope"], layer_types=["attention"] * 3))
    from kvwall.spec.hf import spec_from_config

    spec = spec_from_config(cfg.to_dict())
    assert spec.residual_scale == 0.5
    from kvwall.engine.decode_stack import DecodeStack, kernel_module

    assert DecodeStack.build(Transformer(spec)) is None
    if kernel_module() is not None:  # the same model without the multiplier is one the stack takes
        assert DecodeStack.build(Transformer(replace(spec, residual_scale=1.0))) is not None


def test_engine_builds_the_catalog_model_with_the_predicted_parameters():
    """granite-4.0-h-small's config on the meta device: the engine's parameters are the predictor's count, which
    tests/predict holds equal to transformers' (32,207,337,984)."""
    assert catalog_params("granite-4.0-h-small") == (32207337984, 32207337984)
