"""Multimodal Qwen3.5 (qwen3_5, qwen3_5_moe: the checkpoints as released): the language model under text_config,
the vision tower and patch merger counted as extra parameters.

References: transformers 5.25's multimodal model built on the meta device (AutoModelForImageTextToText maps both
types to Qwen3_5(Moe)ForConditionalGeneration), its cache after a text-only prefill, its config classes' defaults,
and hand arithmetic.
"""

from dataclasses import replace

import pytest

from kvwall.errors import KvwallError
from kvwall.predict.memory import Formats, memory
from kvwall.spec.hf import spec_from_config

TEXT = dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=3, max_position_embeddings=128)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
CONFIGS = {
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(TEXT, intermediate_size=80), vision_config=VISION),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(TEXT, **MOE), vision_config=VISION),
}


def _transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _meta_params(cfg: dict) -> int:
    import torch

    transformers = _transformers()
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(
            transformers.AutoConfig.for_model(cfg["model_type"], **kwargs))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("tied", [False, True])
def test_parameters_equal_the_multimodal_meta_model(model_type, tied):
    """Language model + vision tower + merger: kvwall's params (extra_params included) and bf16 weight bytes are
    transformers' meta-device count of the whole ForConditionalGeneration model. The wrapper's
    tie_word_embeddings decides the lm_head, as transformers' model does."""
    cfg = dict(CONFIGS[model_type], tie_word_embeddings=tied)
    n = _meta_params(cfg)
    spec = spec_from_config(cfg)
    assert spec.params() == n
    assert memory(spec, formats=Formats.for_spec(spec, weights="bf16")).weight_bytes == 2 * n
    assert spec.tied_embeddings == tied


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_transformers_default_config_counts_the_same(model_type):
    """transformers' own default config (to_dict, as `kvwall memory` reads a saved config.json): the same count
    as its meta-device model of that config."""
    transformers = _transformers()
    cfg = transformers.AutoConfig.for_model(model_type).to_dict()
    assert spec_from_config(cfg).params() == _meta_params(cfg)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_the_language_model_is_the_text_only_parse(model_type):
    """The wrapper's layers, vocabulary and embeddings are those of the text family parsing the same text_config;
    only the model type, the extra (vision) parameters and a note differ."""
    cfg = CONFIGS[model_type]
    text = spec_from_config(dict(cfg["text_config"], model_type=f"{model_type}_text"))
    wrapped = spec_from_config(cfg)
    assert wrapped.extra_params > 0 and text.extra_params == 0
    assert replace(wrapped, model_type=text.model_type, extra_params=0, notes=text.notes) == text


def test_the_default_vision_tower_by_hand():
    """transformers 5.25's Qwen3_5VisionConfig defaults: hidden 1152, MLP 4304, depth 27, patch 16 x 16 x 2
    frames x 3 channels, 2,304 positions, merge 2 x 2, out 3584.

    embeddings: Conv3d 3 x 2 x 16 x 16 x 1152 + 1152 = 1,770,624; positions 2,304 x 1152 = 2,654,208.
    block: 2 LayerNorms 4 x 1152 = 4,608; qkv 1152 x 3456 + 3456 = 3,984,768; proj 1152^2 + 1152 = 1,328,256;
      fc1 1152 x 4304 + 4304 = 4,962,512; fc2 4304 x 1152 + 1152 = 4,959,360 -> 15,239,504; x 27 = 411,466,608.
    merger: LayerNorm 2,304; fc1 4608^2 + 4608 = 21,238,272; fc2 4608 x 3584 + 3584 = 16,518,656 -> 37,759,232.
    total 1,770,624 + 2,654,208 + 411,466,608 + 37,759,232 = 453,650,672; with out 2048 (a 2048-wide language
    model) fc2 is 4608 x 2048 + 2048 = 9,439,232: 446,571,248.
    """
    text = dict(TEXT, intermediate_size=80)
    assert spec_from_config(dict(model_type="qwen3_5", text_config=text)).extra_params == 453_650_672
    cfg = dict(model_type="qwen3_5", text_config=text, vision_config={"out_hidden_size": 2048})
    assert spec_from_config(cfg).extra_params == 446_571_248


@pytest.mark.parametrize("length", [5, 9])
def test_cache_equals_the_multimodal_model_cache_after_a_text_prefill(length):
    """A tiny random qwen3_5_moe in fp32, a text-only prefill of `length` tokens: the linear layers' conv + recurrent
    state is kvwall's fixed state (the same at both lengths), the attention layers' K/V is kvwall's cache per token
    x length."""
    import torch

    transformers = _transformers()
    cfg = CONFIGS["qwen3_5_moe"]
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model(
        "qwen3_5_moe", text_config=cfg["text_config"], vision_config=cfg["vision_config"])).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 100, (1, length)), use_cache=True).past_key_values
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    linear = attention = 0
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            linear += sum(size(t) for t in layer.conv_states.values()) + sum(
                size(t) for t in layer.recurrent_states.values())
        else:
            attention += size(layer.keys) + size(layer.values)
    assert linear > 0 and attention > 0
    spec = spec_from_config(cfg)
    report = memory(spec, context=length, formats=Formats.for_spec(spec, kv="fp32", state="fp32"))
    assert (report.fixed_bytes, report.token_bytes * length) == (linear, attention)


@pytest.mark.parametrize("change, words", [
    ({"depth": 0}, "'depth' is 0"),
    ({"hidden_size": "1152"}, "'hidden_size' is '1152'"),
    ({"num_heads": 5}, "not a multiple of num_heads"),
    ({"num_heads": 4, "num_attention_heads": 8}, "name the same field"),
    ({"patch_size": [16, 16]}, "'patch_size'"),
])
def test_a_bad_vision_field_is_a_one_line_error(change, words):
    cfg = dict(CONFIGS["qwen3_5"], vision_config=dict(VISION, **change))
    with pytest.raises(KvwallError, match=words) as err:
        spec_from_config(cfg)
    assert "\n" not in str(err.value) and "vision_config" in str(err.value)


def test_a_bad_text_field_names_text_config():
    cfg = dict(CONFIGS["qwen3_5"], text_config=dict(TEXT, intermediate_size=80, layer_types=["full_attention"]))
    with pytest.raises(KvwallError, match="text_config: layer_types must list one type per layer"):
        spec_from_config(cfg)


def test_the_catalog_moe_model_at_128k_by_hand():
    """Qwen3.6-35B-A3B (qwen3_5_moe): 10 full-attention layers x K and V x 2 kv heads x 256 x 2 B = 20,480 B per
    token; 30 Gated DeltaNet layers x (conv (2 x 16 x 128 + 32 x 128) x 4 = 32,768 + recurrent 32 x 128 x 128 =
    524,288) x 2 B = 30 x 1,114,112 = 33,423,360 B of state; at 131,072 tokens 2,684,354,560 + 33,423,360 B. Its
    vision tower: the default tower with out_hidden_size 2048, 446,571,248 parameters."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("qwen3.6-35b-a3b")
    report = memory(spec, context=131_072)
    assert (report.token_bytes, report.fixed_bytes) == (20_480, 33_423_360)
    assert report.cache_bytes == 2_684_354_560 + 33_423_360
    assert spec.extra_params == 446_571_248 and spec.model_type == "qwen3_5_moe"
