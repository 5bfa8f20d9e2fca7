"""Hybrids (Jamba, Nemotron-H) in the engine: the right cache for each layer, its bytes against the predictor
and by hand, decode across a prefill chunk, padded batches, and what their configs say that others do not.

The generic checks against transformers (full forward, decode with every exact cache, greedy generation)
run for both families in test_models.py through tiny_checkpoints.py.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_checkpoints import NEMOTRON_H, ids, make_checkpoint  # noqa: E402

from kvwall.engine.caches import ModelCache, make_cache  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.predict.memory import Formats, memory  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402
from kvwall.spec.model import Attention, Mamba, Mamba2  # noqa: E402

HYBRIDS = ["jamba", "nemotron_h"]
FP32 = Formats(get_format("fp32"), get_format("fp32"), get_format("fp32"))
# per sequence, fp32, from tiny_checkpoints' configs:
#   jamba: attention on layers 1, 3 (2 KV heads x 16, K and V); Mamba on 0, 2 (d_inner 128 x (d_conv 4 + d_state 8))
#   nemotron_h "M*-EM-": attention on 1; Mamba-2 on 0, 4 (conv 128 + 2·2·16 = 192 channels x 4, 8 heads x 16 x 16)
BY_HAND = {"jamba": (2 * 2 * 2 * 16 * 4, 2 * 128 * (4 + 8) * 4),
           "nemotron_h": (1 * 2 * 2 * 16 * 4, 2 * (192 * 4 + 8 * 16 * 16) * 4)}  # (KV bytes per token, state bytes)


@pytest.fixture(scope="module")
def hybrid(checkpoint):
    """hybrid(family) -> engine model (the checkpoints are the session's, shared with test_models)."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = load_model(checkpoint(family)[0])
        return made[family]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRIDS)
def test_cache_holds_kv_for_attention_layers_and_state_for_ssm_layers(family, hybrid):
    spec = hybrid(family).spec
    cache = make_cache("contiguous", spec, 2, 32)
    assert isinstance(cache, ModelCache)
    kv = [i for i, layer in enumerate(cache.kv.layers) if layer is not None]
    state = [i for i, s in enumerate(cache.state.layers) if s is not None]
    assert kv == [i for i, layer in enumerate(spec.layers)
                  if isinstance(layer.mixer, Attention)] == spec.attention_layers()
    assert state == [i for i, layer in enumerate(spec.layers) if isinstance(layer.mixer, (Mamba, Mamba2))]
    expected = {"jamba": ([1, 3], [0, 2]), "nemotron_h": ([1], [0, 4])}[family]
    assert (kv, state) == expected  # nemotron_h's MLP / MoE blocks (2, 3, 5) hold nothing


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRIDS)
def test_cache_bytes_equal_the_predictor_state_constant_kv_linear(family, hybrid):
    """Run to 16 and to 300 tokens: KV grows by its per-token bytes, the state stays, both equal predict's."""
    model = hybrid(family)
    per_token, state = BY_HAND[family]
    B, held = 2, {}
    for length in (16, 300):
        cache = make_cache("contiguous", model.spec, B, length)
        x = ids(B, length)
        with torch.no_grad():
            model(x[:, :length - 4], None, cache)
            for t in range(length - 4, length):
                model(x[:, t:t + 1], torch.full((B, 1), t), cache)
        assert cache.state.seen == [length] * B
        predicted = memory(model.spec, batch=B, context=length, formats=FP32).cache_bytes
        assert cache.nbytes() == predicted == B * (per_token * length + state)
        held[length] = (cache.kv.nbytes(), cache.state.nbytes())
    assert held[16][1] == held[300][1] == B * state  # fixed state: the same after 16 and 300 tokens
    assert held[300][0] - held[16][0] == B * per_token * (300 - 16)  # KV: linear in length
    gen = generate(model, [[1, 2, 3]], max_new_tokens=5)
    assert gen.cache_bytes == memory(model.spec, batch=1, context=3 + 5, formats=FP32).cache_bytes


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRIDS)
def test_prefill_chunk_on_top_of_the_cache_then_decode_equals_full_forward(family, hybrid):
    """Prefill 5, a chunk of 7 (attention over cached K/V, SSMs continuing their state), then one at a time."""
    model = hybrid(family)
    x = ids(length=24)
    B, T = x.shape
    with torch.no_grad():
        full = model(x)
        c = make_cache("paged", model.spec, B, T, block_size=4)
        steps = [model(x[:, :5], None, c), model(x[:, 5:12], torch.arange(5, 12).expand(B, 7), c)]
        steps += [model(x[:, t:t + 1], torch.full((B, 1), t), c) for t in range(12, T)]
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRIDS)
def test_right_padded_batch_equals_one_by_one(family, hybrid):
    model = hybrid(family)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 17, 8)]
    batch = generate(model, prompts, max_new_tokens=10).tokens
    alone = [generate(model, [p], max_new_tokens=10).tokens[0] for p in prompts]
    assert batch == alone


def test_jamba_attention_has_no_positions(hybrid):
    """transformers' Jamba attention applies no rotary or learned positions; neither does the engine."""
    model = hybrid("jamba")
    assert all(layer.mixer.rope is None for layer in model.spec.layers if isinstance(layer.mixer, Attention))
    assert len(model.rotary) == 0 and model.pos_embed is None
    m = next(layer.mixer for layer in model.spec.layers if isinstance(layer.mixer, Mamba))
    assert m.inner_norms and m.inner_norm_eps == 1e-5 == model.spec.norm_eps  # rms_norm_eps, dt/B/C norms too


@pytest.mark.slow
@pytest.mark.parametrize("limit", [(0.01, math.inf), (0.0, math.inf)])
def test_nemotron_h_step_size_is_clamped_to_time_step_limit(tmp_path, limit):
    """transformers (>= 5.25) clamps Δ to the config's time_step_limit in its prefill scan, as mamba_ssm does; an
    older transformers clamped at time_step_min (0.001) instead. With dt_bias = -10, softplus gives ~4.5e-5, so
    a clamp at 0.01 decides the output, and with the default (0, inf) no clamp at 0.001 may be applied."""
    ref = make_checkpoint("nemotron_h", tmp_path / "ckpt", seed=3, config={"time_step_limit": limit})
    assert ref.config.time_step_min == 0.001
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("dt_bias"):
                p.fill_(-10.0)
    ref.save_pretrained(tmp_path / "ckpt")
    model = load_model(tmp_path / "ckpt")
    assert next(layer.mixer for layer in model.spec.layers if isinstance(layer.mixer, Mamba2)).dt_limit == limit
    x = ids(length=20)
    with torch.no_grad():
        assert (model(x) - ref(x).logits).abs().max().item() < 1e-4


def test_nemotron_h_block_list_equals_the_pattern_string():
    """transformers 5 saves layers_block_type (no hybrid_override_pattern, no num_hidden_layers)."""
    saved = transformers.NemotronHConfig(**NEMOTRON_H).to_dict()
    assert "hybrid_override_pattern" not in saved and saved["layers_block_type"][:2] == ["linear_attention",
                                                                                          "full_attention"]
    legacy = {k: v for k, v in saved.items() if k != "layers_block_type"}
    legacy.update(hybrid_override_pattern="M*-EM-", num_hidden_layers=6)
    assert spec_from_config(saved) == spec_from_config(legacy)
    kinds = [(layer.mixer.kind if layer.mixer else None, layer.ffn.kind if layer.ffn else None)
             for layer in spec_from_config(saved).layers]
    assert kinds == [("mamba2", None), ("attention", None), (None, "mlp"), (None, "moe"), ("mamba2", None),
                     (None, "mlp")]


def test_nemotron_h_unknown_block_is_one_line_error():
    saved = json.loads(json.dumps(transformers.NemotronHConfig(**NEMOTRON_H).to_dict(), default=str))
    saved["layers_block_type"][2] = "conv"
    with pytest.raises(KvwallError, match=r"layers_block_type has \['conv'\]; known are") as err:
        spec_from_config(saved)
    assert "\n" not in str(err.value)
    del saved["layers_block_type"]
    with pytest.raises(KvwallError, match="no 'hybrid_override_pattern' or 'layers_block_type'"):
        spec_from_config(saved)
