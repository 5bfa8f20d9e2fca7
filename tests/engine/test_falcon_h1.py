"""Falcon-H1 in the engine (issue #42): attention and Mamba-2 in parallel inside every layer, with Falcon-H1's muP
multipliers, against transformers 5.25's FalconH1ForCausalLM on tiny random checkpoints."""

from __future__ import annotations

import json

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

from kvwall.cli import main  # noqa: E402
from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.predict.memory import Formats, memory  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402

# 2 layers, each attention (4 query heads, 2 KV heads of 16) || Mamba-2 (8 heads x 16, 2 groups of state 16,
# conv 4); every multiplier away from 1 and from the others, so that a missing or misplaced one shows
FALCON_H1 = dict(TINY, intermediate_size=128, num_hidden_layers=2, mamba_d_ssm=128, mamba_n_heads=8,
                 mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16)
MULTIPLIERS = dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.7, 1.3], key_multiplier=1.5,
                   attention_in_multiplier=0.8, attention_out_multiplier=1.2, ssm_in_multiplier=0.9,
                   ssm_out_multiplier=1.1, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3])
VARIANTS = {
    # the gated RMSNorm normalising y before the gate (mamba_norm_before_gate, the config default), biases on
    # out_proj (projectors_bias), q/k/v/o (attention_bias) and the MLP (mlp_bias)
    "muP": dict(FALCON_H1, **MULTIPLIERS, mamba_rms_norm=True, projectors_bias=True, attention_bias=True,
                mlp_bias=True),
    "norm_after_gate": dict(FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=False),
    "no_norm": dict(FALCON_H1),  # the class default: y * silu(z) straight into out_proj
}


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    made = {}

    def get(variant):
        if variant not in made:
            path = tmp_path_factory.mktemp(variant)
            made[variant] = (path, save(transformers.FalconH1Config(**VARIANTS[variant]), path))
        return made[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_forward_and_decode_equal_transformers(falcon, variant):
    path, ref = falcon(variant)
    assert full_forward_error(path, ref) < TOLERANCE
    assert decode_error(path, length=20) < TOLERANCE  # past the 16-token scan chunk


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["muP", "norm_after_gate"])
def test_greedy_20_tokens_equal_transformers_at_batch_1_and_3(falcon, variant):
    path, ref = falcon(variant)
    for lengths in [(12,), (3, 21, 9)]:  # batch 3: right-padded prompts of different lengths
        pairs = greedy_pairs(path, ref, lengths)
        assert all(len(set(want)) > 1 for _, want in pairs), "a degenerate reference would prove little"
        assert [got for got, _ in pairs] == [want for _, want in pairs]


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["sliding", "paged", "int8"])
def test_decode_with_other_caches_equals_full_forward(falcon, cache):
    assert decode_error(falcon("muP")[0], cache) < TOLERANCE


def test_one_layer_holds_both_caches_by_hand(falcon):
    """Per sequence, fp32, each of the 2 layers keeps K and V of 2 heads x 16 per token (256 B) and the Mamba-2
    state: conv (128 + 2 x 2 x 16 = 192 channels x 4) + SSM (8 heads x 16 x 16) = (768 + 2048) x 4 B."""
    model = load_model(falcon("muP")[0])
    B, T = 2, 30
    cache = make_cache("contiguous", model.spec, B, T)
    assert [i for i, kv in enumerate(cache.kv.layers) if kv is not None] == [0, 1]
    assert [i for i, s in enumerate(cache.state.layers) if s is not None] == [0, 1]
    assert cache.kv.nbytes() == B * T * 2 * 2 * 2 * 16 * 4
    assert cache.state.nbytes() == B * 2 * (192 * 4 + 8 * 16 * 16) * 4
    fp32 = Formats(get_format("fp32"), get_format("fp32"), get_format("fp32"))
    assert cache.nbytes() == memory(model.spec, batch=B, context=T, formats=fp32).cache_bytes


def test_verify_passes(falcon, capsys):
    assert main(["verify", str(falcon("muP")[0]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass"] and out["max_abs_logit_diff"] < TOLERANCE


def test_malformed_multiplier_list_is_a_one_line_error():
    saved = json.loads(json.dumps(transformers.FalconH1Config(**VARIANTS["muP"]).to_dict()))
    saved["ssm_multipliers"] = [1.0, 2.0]
    with pytest.raises(KvwallError, match=r"ssm_multipliers is \[1.0, 2.0\]; Falcon-H1 takes a list of 5 numbers") as e:
        spec_from_config(saved)
    assert "\n" not in str(e.value)


def test_engine_builds_the_catalog_model_with_the_predicted_parameters():
    """falcon-h1-34b's config on the meta device: the engine's parameters are the predictor's count, which
    tests/predict holds equal to transformers' (33,642,516,224)."""
    assert catalog_params("falcon-h1-34b") == (33642516224, 33642516224)
