"""kvwall recall's gated_deltanet architecture: the same kept bytes as mamba2 by hand, against the predictor and the
engine's own cache; its parameters are the spec's; it trains through the engine's layers (gradients reach every
Gated DeltaNet parameter)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.measure import recall  # noqa: E402

# per sequence, fp32 (4 B), 2 layers; width w: Mamba-2 has 2w/32 heads x 32 x d_state 64 and a conv over
# E + 2N = 2w + 128 channels x 4 taps; Gated DeltaNet 2w/32 value heads x 32 x key dim 64 and a conv over
# q + k + v = 64 + 64 + 2w channels x 4 taps: the same numbers
BY_HAND = {64: 2 * ((128 + 2 * 64) * 4 + 4 * 32 * 64) * 4, 128: 2 * ((256 + 2 * 64) * 4 + 8 * 32 * 64) * 4}


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 128])
def test_same_kept_bytes_as_mamba2_by_hand_predictor_and_engine(width):
    gdn, mamba2 = (recall.parse_archs(name, 32)[0] for name in ("gated_deltanet", "mamba2"))
    spec = recall.model_spec(gdn, width, 32)
    kept = recall.kept_bytes(spec, 32)
    assert kept["kept_bytes"] == kept["state_bytes"] == BY_HAND[width] == {64: 73_728, 128: 143_360}[width]
    assert recall.kept_bytes(recall.model_spec(mamba2, width, 32), 32) == kept
    model = recall.build(spec, 0).eval()
    cache = make_cache("contiguous", spec, batch=1, max_len=32)
    with torch.no_grad():
        model(recall.mqar(1, 32, 4, seed=0)[0], cache=cache)
    assert cache.nbytes() == BY_HAND[width]  # what the engine holds after the sequence


@pytest.mark.slow
def test_params_are_the_spec_and_training_reaches_every_parameter():
    spec = recall.model_spec(recall.parse_archs("gated_deltanet", 32)[0], 64, 32)
    model = recall.build(spec, 0)
    assert sum(p.numel() for p in model.parameters()) == spec.params()
    tokens, targets = recall.mqar(4, 32, 4, seed=0)
    logits = model(tokens)  # (4, 32, vocab)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=recall.IGNORE).backward()
    mixer = model.layers[0].mixer
    for name in ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
        grad = mixer.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_its_rate_and_the_unknown_name_message():
    arch = recall.parse_archs("gated_deltanet", 64)[0]
    assert recall.rate(arch, 128, recall.Plan(seq=64)) == recall.KINDS["gated_deltanet"].lr  # not width-scaled
    with pytest.raises(KvwallError, match="gated_deltanet"):
        recall.parse_archs("deltanet", 64)
