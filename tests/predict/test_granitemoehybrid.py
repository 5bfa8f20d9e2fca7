"""Granite 4.0 hybrids (granitemoehybrid): parsing, weight bytes, fixed state and cache.

The references are transformers 5.25's own objects (its config class for defaults and the layer pattern, its model
on the meta device for parameter counts, its cache after a prefill for state and K/V bytes) and hand arithmetic on
Granite-4.0-H-Small's config.
"""

import pytest

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.predict.memory import Formats, memory
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import Attention, Mamba2, MoE

TINY = dict(model_type="granitemoehybrid", vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=24, shared_intermediate_size=40, num_local_experts=4,
            num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
            mamba_d_conv=3, layer_types=["mamba", "attention", "mamba", "mamba"], max_position_embeddings=64)


def _transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    {},  # routed experts + the shared MLP on every layer
    {"num_local_experts": 0, "num_experts_per_tok": 0},  # dense: the shared MLP alone
    {"attention_bias": True, "position_embedding_type": "rope", "tie_word_embeddings": True},
    {"layer_types": None, "mamba_d_head": "auto", "mamba_proj_bias": True, "mamba_conv_bias": False},
])
def test_bf16_weight_bytes_equal_transformers_meta_model(extra):
    """transformers builds the model from the same config on the meta device; its parameters x 2 bytes are kvwall's
    bf16 weight bytes."""
    import torch

    transformers = _transformers()
    cfg = {k: v for k, v in dict(TINY, **extra).items() if v is not None}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    n = sum(p.numel() for p in model.parameters())
    spec = spec_from_config(cfg)
    assert spec.params() == n
    assert memory(spec, formats=Formats.for_spec(spec, weights="bf16")).weight_bytes == 2 * n


@pytest.mark.slow
@pytest.mark.parametrize("types", [None, ["attention", "mamba", "mamba", "attention"],
                                   ["full_attention", "linear_attention", "mamba", "attention"]])
def test_the_layer_pattern_is_transformers_own(types):
    """No layer_types (every layer Mamba-2, as transformers derives it), the checkpoints' names and transformers
    5.25's own: kvwall's mixer per layer follows the layer_types transformers' config object holds."""
    transformers = _transformers()
    cfg = {k: v for k, v in dict(TINY, layer_types=types).items() if v is not None}
    want = transformers.AutoConfig.for_model(**cfg).layer_types
    got = ["full_attention" if isinstance(layer.mixer, Attention) else "linear_attention"
           for layer in spec_from_config(cfg).layers]
    assert got == want


@pytest.mark.slow
def test_missing_fields_take_transformers_defaults():
    """A config without the mamba_* and expert fields: kvwall's Mamba-2 and MoE shapes are the attributes of
    transformers' config object for the same dict (mamba_d_head "auto": expand x hidden / heads)."""
    transformers = _transformers()
    cfg = dict(model_type="granitemoehybrid", vocab_size=100, hidden_size=256, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=32, layer_types=["mamba", "attention"])
    hf = transformers.AutoConfig.for_model(**cfg)
    spec = spec_from_config(cfg)
    mamba, moe = spec.layers[0].mixer, spec.layers[0].ffn
    assert (mamba.n_heads, mamba.head_dim, mamba.d_state, mamba.n_groups, mamba.d_conv, mamba.conv_bias,
            mamba.proj_bias) == (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups,
                                 hf.mamba_d_conv, hf.mamba_conv_bias, hf.mamba_proj_bias)
    assert (moe.n_experts, moe.top_k, moe.d_shared) == (hf.num_local_experts, hf.num_experts_per_tok,
                                                        hf.shared_intermediate_size)
    assert spec.layers[1].mixer.n_kv_heads == hf.num_key_value_heads


@pytest.mark.slow
@pytest.mark.parametrize("length", [5, 9])
def test_fixed_state_and_cache_equal_transformers_cache_after_a_prefill(length):
    """A tiny random granitemoehybrid in fp32 on CPU, one prefill of `length` tokens with use_cache: the Mamba-2
    layers' conv + SSM state tensors are kvwall's fixed state (the same at both lengths), the attention layer's K/V
    bytes are kvwall's cache per token x length (state and cache counted in fp32)."""
    import torch

    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY)).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, length)), use_cache=True).past_key_values
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = attention = 0
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):
            state += sum(size(t) for t in layer.conv_states.values()) + sum(
                size(t) for t in layer.recurrent_states.values())
        else:
            attention += size(layer.keys) + size(layer.values)
    # by hand: 3 Mamba-2 layers x (conv (128 + 2 x 2 x 8) x 3 + SSM 8 x 16 x 8) x 4 B; one layer of 2 x 2 x 16 x 4 B
    assert state == 3 * (160 * 3 + 1024) * 4 and attention == length * 256
    spec = spec_from_config(TINY)
    report = memory(spec, context=length, formats=Formats.for_spec(spec, kv="fp32", state="fp32"))
    assert report.fixed_bytes == state
    assert report.token_bytes * length == attention
    assert report.cache_bytes == state + attention


def test_one_granite_4_h_small_layer_by_hand():
    """Granite-4.0-H-Small (hidden 4096): Mamba-2 128 heads x 64, d_state 128, 1 group, conv 4; GQA 32 q / 8 kv x 128;
    72 experts of 768 top-10 + a shared MLP of 1536.

    Mamba-2 state: conv (8192 + 2 x 128) x 4 = 33,792 + SSM 128 x 64 x 128 = 1,048,576 -> 1,082,368 x 2 B
      = 2,164,736 B per sequence; tp=2: heads 64, the single group kept on both GPUs: conv (4096 + 256) x 4
      = 17,408 + 524,288 -> 541,696 x 2 B = 1,083,392 B.
    Mamba-2 params: in_proj 4096 x (2 x 8192 + 2 x 128 + 128) = 68,681,728, conv 8448 x 4 + 8448 bias = 42,240,
      dt_bias / A_log / D 384, gated norm 8192, out_proj 8192 x 4096 = 33,554,432 -> 102,286,976.
    Attention: q 16,777,216, k and v 4096 x 1024 = 4,194,304 each, o 16,777,216 -> 41,943,040; cache per token
      2 x 8 x 128 x 2 B = 4,096 B.
    MoE: router 4096 x 72 = 294,912, experts 72 x 3 x 4096 x 768 = 679,477,248, shared 3 x 4096 x 1536
      = 18,874,368 -> 698,646,528; active: router + 10 experts 94,371,840 + shared -> 113,541,120.
    """
    mamba = Mamba2(128, 64, 128, 1, 4)
    bf16 = get_format("bf16")
    rules = mixers.of(mamba)
    assert rules.fixed_bytes(mamba, bf16) == 2_164_736 and rules.fixed_bytes(mamba, bf16, tp=2) == 1_083_392
    assert mamba.params(4096) == 102_286_976
    attn = Attention(32, 8, 128, 128)
    assert attn.params(4096) == 41_943_040 and mixers.of(attn).token_bytes(attn, bf16) == 4_096
    moe = MoE(72, 10, 768, n_shared=1, d_shared=1536)
    assert moe.params(4096) == 698_646_528 and moe.active_params(4096) == 113_541_120


def test_the_catalog_model_by_hand():
    """36 Mamba-2 layers x 2,164,736 B = 77,930,496 B of state; 4 attention layers x 4,096 B = 16,384 B per token,
    x 131,072 tokens = 2,147,483,648 B. Parameters: tied embedding 100,352 x 4096 = 411,041,792, 36 x (102,286,976
    + 698,646,528 + 2 x 4096 norms) + 4 x (41,943,040 + 698,646,528 + 8192) + final norm 4096 = 32,207,337,984."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("granite-4.0-h-small")
    report = memory(spec, context=131_072)
    assert (report.fixed_bytes, report.token_bytes) == (77_930_496, 16_384)
    assert report.cache_bytes == 77_930_496 + 2_147_483_648
    assert spec.params() == 32_207_337_984
    assert [i for i, layer in enumerate(spec.layers) if isinstance(layer.mixer, Attention)] == [5, 15, 25, 35]


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["mamba", "moe", "mamba", "mamba"]}, "layer_types has"),
    ({"layer_types": ["mamba"] * 3}, "one type per layer"),
    ({"mamba_d_head": 8}, "mamba_n_heads x mamba_d_head"),
    ({"mamba_n_groups": 3}, "n_groups"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_what_it_cannot_honour_is_a_clear_error(change, words):
    with pytest.raises(KvwallError, match=words):
        spec_from_config(dict(TINY, **change))


def test_the_engine_runs_it():
    """Issue #42 brought it into the engine (tests/engine/test_granitemoehybrid.py holds it equal to transformers)."""
    from kvwall.spec.families import family

    fam = family("granitemoehybrid")
    assert fam.runs_in_engine and fam.layout == "granitemoehybrid"
