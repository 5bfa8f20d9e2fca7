"""Layer patterns from config.json, held against the configs' own documented rules and transformers."""

import pytest

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import Attention, LatentAttention, Mamba, Mamba2, MoE
from kvwall.spec.resolve import load_spec


def kinds(spec):
    return [type(layer.mixer).__name__ if layer.mixer else None for layer in spec.layers]


def test_gemma3_27b_local_global():
    spec = load_spec("gemma-3-27b")
    windows = [layer.mixer.window for layer in spec.layers]
    # Gemma 3: every 6th layer (i+1) % 6 == 0 is global, the rest slide over 1024 tokens
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert set(w for w in windows if w) == {1024}
    assert spec.layers[0].mixer.rope.theta == 10_000.0 and spec.layers[5].mixer.rope.theta == 1_000_000.0


def test_jamba_attention_and_expert_periods():
    spec = load_spec("jamba-v0.1")
    assert [i for i, layer in enumerate(spec.layers) if isinstance(layer.mixer, Attention)] == [4, 12, 20, 28]
    assert [i for i, layer in enumerate(spec.layers) if isinstance(layer.ffn, MoE)] == list(range(1, 32, 2))
    assert all(isinstance(layer.mixer, Mamba) for i, layer in enumerate(spec.layers) if i % 8 != 4)


def test_nemotron_h_pattern():
    spec = load_spec("nemotron-h-8b")
    assert [i for i, layer in enumerate(spec.layers) if isinstance(layer.mixer, Attention)] == [7, 18, 29, 40]
    assert sum(isinstance(layer.mixer, Mamba2) for layer in spec.layers) == 24
    assert sum(layer.mixer is None for layer in spec.layers) == 24
    m = next(layer.mixer for layer in spec.layers if isinstance(layer.mixer, Mamba2))
    assert m.conv_dim == 8192 + 2 * 8 * 128


def test_deepseek_first_dense_layers():
    spec = load_spec("deepseek-v3")
    assert all(isinstance(layer.mixer, LatentAttention) for layer in spec.layers)
    assert [i for i, layer in enumerate(spec.layers) if not isinstance(layer.ffn, MoE)] == [0, 1, 2]
    lite = load_spec("deepseek-v2-lite")
    assert lite.layers[0].mixer.q_lora_rank is None


def test_mistral_sliding_window_everywhere():
    spec = load_spec("mistral-7b-v0.1")
    assert {layer.mixer.window for layer in spec.layers} == {4096}


def test_explicit_head_dim_and_layer_types_win(write_config):
    cfg = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "vocab_size": 100,
           "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    spec = load_spec(str(write_config(cfg)))
    assert [layer.mixer.head_dim for layer in spec.layers] == [32, 32, 32]  # not 64 / 4
    assert [layer.mixer.window for layer in spec.layers] == [16, None, 16]


def test_multimodal_gemma3_uses_text_config():
    spec = load_spec("gemma-3-4b")
    assert spec.model_type == "gemma3" and spec.hidden == 2560 and spec.n_layers == 34


def test_transformers_agrees_on_sliding_layers():
    """transformers' own config classes compute layer_types; kvwall's windows must agree."""
    transformers = pytest.importorskip("transformers")
    checked = 0
    for name in catalog.model_names():
        raw = {k: v for k, v in catalog.load_model_config(name).items() if not k.startswith("_")}
        if raw.get("model_type") not in ("gemma3_text", "gemma2", "mistral", "qwen2", "qwen3", "gemma3"):
            continue
        cfg = transformers.AutoConfig.for_model(**raw)
        cfg = getattr(cfg, "text_config", None) or cfg
        types = getattr(cfg, "layer_types", None)
        if types is None:
            continue
        spec = load_spec(name)
        ours = ["sliding_attention" if layer.mixer.window else "full_attention" for layer in spec.layers]
        assert ours == list(types), name
        checked += 1
    assert checked >= 4


# -- bad input ---------------------------------------------------------------

def test_unknown_model_type_lists_supported():
    with pytest.raises(KvwallError, match="not supported; supported: .*llama"):
        spec_from_config({"model_type": "bert"})


def test_missing_field_names_field_and_file():
    with pytest.raises(KvwallError, match=r"my/config.json has no 'num_attention_heads'"):
        spec_from_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                          "intermediate_size": 128, "vocab_size": 10}, where="my/config.json")


def test_zero_or_negative_sizes_rejected():
    with pytest.raises(KvwallError, match="'hidden_size' is 0"):
        spec_from_config({"model_type": "llama", "hidden_size": 0, "num_hidden_layers": 2})


def test_malformed_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama",')
    with pytest.raises(KvwallError, match="not valid JSON"):
        load_spec(str(p))


def test_unknown_model_name():
    with pytest.raises(KvwallError, match="unknown model 'no-such-model'"):
        load_spec("no-such-model")


def test_every_catalog_entry_has_hub_id_and_source():
    names = catalog.model_names()
    assert len(names) >= 20
    for name in names:
        cfg = catalog.load_model_config(name)
        assert cfg.get("_hub_id", "").count("/") == 1, name
        assert cfg.get("_source"), name
