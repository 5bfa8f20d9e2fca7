"""LFM2 in the engine (issue #42): short-convolution layers beside GQA attention with q/k norms, against
transformers 5.25's Lfm2ForCausalLM on a tiny random checkpoint."""

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
from kvwall.predict.memory import Formats, memory  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402

# conv, attention, conv, attention; 3 taps; MLP 192 -> int(2 x 192 / 3) = 128 (a multiple of 32)
LFM2 = dict(TINY, intermediate_size=192, num_hidden_layers=4, conv_L_cache=3, block_multiple_of=32,
            layer_types=["conv", "full_attention", "conv", "full_attention"])


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    path = tmp_path_factory.mktemp("lfm2")
    return path, save(transformers.Lfm2Config(**LFM2), path)


def test_full_forward_and_decode_equal_transformers(lfm2):
    path, ref = lfm2
    assert full_forward_error(path, ref) < TOLERANCE
    assert decode_error(path, length=20) < TOLERANCE  # 20 tokens: well past the 3 taps


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["sliding", "paged", "int8"])
def test_decode_with_other_caches_equals_full_forward(lfm2, cache):
    assert decode_error(lfm2[0], cache) < TOLERANCE


@pytest.mark.slow
def test_greedy_20_tokens_equal_transformers_at_batch_1_and_3(lfm2):
    path, ref = lfm2
    for lengths in [(12,), (3, 21, 9)]:  # batch 3: right-padded prompts of different lengths
        pairs = greedy_pairs(path, ref, lengths)
        assert all(len(set(want)) > 1 for _, want in pairs), "a degenerate reference would prove little"
        assert [got for got, _ in pairs] == [want for _, want in pairs]


def test_state_bytes_by_hand_and_equal_the_predictor(lfm2):
    """Per sequence, fp32: conv layers 0 and 2 keep 64 channels x 3 inputs (3 x 64 x 4 = 768 B each, whatever the
    length); attention layers 1 and 3 keep K and V of 2 heads x 16 per token (256 B each per token)."""
    model = load_model(lfm2[0])
    B, T = 2, 30
    cache = make_cache("contiguous", model.spec, B, T)
    with torch.no_grad():
        model(torch.zeros(B, T, dtype=torch.long), None, cache)
    assert cache.state.nbytes() == B * 2 * 64 * 3 * 4
    assert cache.kv.nbytes() == B * T * 2 * (2 * 2 * 16 * 4)
    fp32 = Formats(get_format("fp32"), get_format("fp32"), get_format("fp32"))
    assert cache.nbytes() == memory(model.spec, batch=B, context=T, formats=fp32).cache_bytes


def test_verify_passes(lfm2, capsys):
    assert main(["verify", str(lfm2[0]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass"] and out["max_abs_logit_diff"] < TOLERANCE


def test_engine_builds_the_catalog_model_with_the_predicted_parameters():
    """lfm2-1.2b's config on the meta device: the engine's parameters are the predictor's count, which
    tests/predict holds equal to transformers' (1,170,340,608)."""
    assert catalog_params("lfm2-1.2b") == (1170340608, 1170340608)
