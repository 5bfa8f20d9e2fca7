"""Every mixer kind the spec knows has its predict module, and that module answers every question."""

import pytest

from kvwall.predict import mixers
from kvwall.spec import model

SEQUENCE = ["token_bytes", "tokens_held", "fixed_bytes", "shard_params", "ops", "label"]
CHANNEL = ["shard_params", "ops"]


@pytest.mark.parametrize("cls", [model.Attention, model.LatentAttention, model.Mamba, model.Mamba2,
                                 model.GatedDeltaNet, model.ShortConv, model.ParallelHybrid,
                                 model.KimiDeltaAttention, model.LightningAttention,
                                 model.SparseLatentAttention])
def test_sequence_mixers_have_a_module(cls):
    rules = mixers._module(cls.kind)
    assert [f for f in SEQUENCE if not callable(getattr(rules, f, None))] == []


@pytest.mark.parametrize("cls", [model.MLP, model.MoE])
def test_channel_mixers_have_a_module(cls):
    rules = mixers._module(cls.kind)
    assert [f for f in CHANNEL if not callable(getattr(rules, f, None))] == []


def test_a_sliding_layer_keeps_at_most_its_window():
    attn = model.Attention(8, 2, 64, 64, window=1000)
    rules = mixers.of(attn)
    assert (rules.tokens_held(attn, 500), rules.tokens_held(attn, 5000)) == (500, 1000)
    assert rules.label(attn) == "sliding"
