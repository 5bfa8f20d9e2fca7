"""Parameter counts: hand calculations, published figures, and transformers itself."""

import pytest

from kvwall import catalog
from kvwall.spec.resolve import load_spec


def test_gpt2_small_by_hand():
    # wte 50257*768 + wpe 1024*768 + 12 * (2 LayerNorms 4*768 + c_attn 768*2304+2304 + c_proj 768*768+768
    #   + c_fc 768*3072+3072 + c_proj 3072*768+768) + ln_f 2*768; lm_head tied.
    layer = 4 * 768 + (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768)
    expected = 50257 * 768 + 1024 * 768 + 12 * layer + 2 * 768
    assert expected == 124_439_808  # the published GPT-2 small count
    assert load_spec("gpt2").params() == expected


def test_llama3_8b_by_hand():
    h, kv, ff, v = 4096, 1024, 14336, 128256
    layer = 2 * h * h + 2 * h * kv + 3 * h * ff + 2 * h
    expected = 2 * v * h + 32 * layer + h
    assert expected == 8_030_261_248
    assert load_spec("llama-3-8b").params() == expected
    assert load_spec("meta-llama/Meta-Llama-3-8B").params() == expected  # the hub id resolves to the catalog


@pytest.mark.parametrize("name, total, active", [
    ("deepseek-v3", 671e9, 37e9),   # DeepSeek-V3 report: 671B total, 37B activated (MTP module excluded)
    ("jamba-v0.1", 52e9, 12e9),     # AI21: 52B total, 12B active
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Mistral: 46.7B total, 12.9B active
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # Qwen3 model card: 30.5B total, 3.3B activated
])
def test_moe_total_and_active_match_published(name, total, active):
    spec = load_spec(name)
    assert spec.params() == pytest.approx(total, rel=0.01)
    assert spec.active_params() == pytest.approx(active, rel=0.03)


def _hf_param_count(cfg: dict) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    if cfg.get("model_type") == "llama4":  # Llama 4 Scout publishes attn_temperature_tuning 4, which 5.25's strict
        # config class refuses (it wants a bool, and reads it as one); AutoModelForCausalLM would build the text part
        text = cfg["text_config"]
        cfg = dict(cfg, text_config=dict(text, attn_temperature_tuning=bool(text.get("attn_temperature_tuning", 1))))
        with torch.device("meta"):
            model = transformers.Llama4ForConditionalGeneration(transformers.AutoConfig.for_model(**cfg))
        return sum(p.numel() for p in model.parameters())
    if cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe"):  # AutoModelForCausalLM maps these to the text-only
        # Qwen3_5(Moe)ForCausalLM; the released checkpoint is the multimodal model, vision tower included
        with torch.device("meta"):
            model = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model(**cfg))
        return sum(p.numel() for p in model.parameters())
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        except ValueError:
            model = transformers.AutoModelForImageTextToText.from_config(hf_cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", [n for n in catalog.model_names() if "model_type" in catalog.load_model_config(n)])
def test_catalog_params_equal_transformers(name):
    """transformers builds each catalog model on the meta device: its count is the independent reference."""
    cfg = {k: v for k, v in catalog.load_model_config(name).items() if not k.startswith("_")}
    try:
        expected = _hf_param_count(cfg)
    except (ValueError, KeyError) as exc:  # model_type unknown to the installed transformers
        pytest.skip(f"installed transformers cannot build {name}: {exc}")
    assert load_spec(name).params() == expected


def test_mamba2_ssm_format_matches_published_size():
    # state-spaces/mamba2-2.7b: 2.7B parameters; hand count of one layer:
    # in_proj 2560*(2*5120 + 2*128 + 80), conv 5376*4 + 5376, dt_bias/A_log/D 3*80, norm 5120, out 5120*2560,
    # + norm 2560
    layer = 2560 * (2 * 5120 + 2 * 128 + 80) + 5376 * 5 + 3 * 80 + 5120 + 5120 * 2560 + 2560
    expected = 50288 * 2560 + 64 * layer + 2560
    assert load_spec("mamba2-2.7b").params() == expected
    assert expected == pytest.approx(2.7e9, rel=0.01)
