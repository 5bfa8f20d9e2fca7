"""Gated DeltaNet (qwen3_next, qwen3_5_text, qwen3_5_moe_text): parsing, weight bytes, fixed state and cache.

The references are transformers 5.25's own objects (its config class for defaults and the layer pattern, its model
on the meta device for parameter counts, its cache after a prefill for state and K/V bytes) and hand arithmetic.
"""

import pytest

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.predict.memory import Formats, memory
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import Attention, GatedDeltaNet

TINY = dict(vocab_size=100, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=3)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CONFIGS = {
    # MoE on odd layers (decoder_sparse_step 2) except layer 3 (mlp_only_layers): both channel mixers appear
    "qwen3_next": dict(TINY, model_type="qwen3_next", intermediate_size=80, decoder_sparse_step=2,
                       mlp_only_layers=[3], **MOE),
    "qwen3_5_text": dict(TINY, model_type="qwen3_5_text", intermediate_size=80),
    "qwen3_5_moe_text": dict(TINY, model_type="qwen3_5_moe_text", **MOE),
}


def _transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_bf16_weight_bytes_equal_transformers_meta_model(model_type):
    """transformers builds the model from the same config on the meta device; its parameters x 2 bytes are
    kvwall's bf16 weight bytes."""
    import torch

    transformers = _transformers()
    cfg = CONFIGS[model_type]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    n = sum(p.numel() for p in model.parameters())
    spec = spec_from_config(cfg)
    assert spec.params() == n
    assert memory(spec, formats=Formats.for_spec(spec, weights="bf16")).weight_bytes == 2 * n


MIXED = ["full_attention", "linear_attention", "full_attention"] + ["linear_attention"] * 3


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("extra", [{}, {"full_attention_interval": 3}, {"layer_types": MIXED}])
def test_the_layer_pattern_is_transformers_own(model_type, extra):
    """Default interval 4, another interval, and an explicit layer_types: kvwall's mixer per layer follows the
    layer_types transformers' config object derives."""
    transformers = _transformers()
    cfg = dict(CONFIGS[model_type], **extra)
    types = transformers.AutoConfig.for_model(**cfg).layer_types
    spec = spec_from_config(cfg)
    got = ["full_attention" if isinstance(layer.mixer, Attention) else "linear_attention" for layer in spec.layers]
    assert got == types and "linear_attention" in got and "full_attention" in got


def test_missing_fields_take_transformers_defaults():
    """A config without the linear_*, head_dim, kv-head and MoE fields: kvwall's values are the attributes of
    transformers' config object for the same dict."""
    transformers = _transformers()
    cfg = dict(model_type="qwen3_next", vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    hf = transformers.AutoConfig.for_model(**cfg)
    spec = spec_from_config(cfg)
    gdn, attn, moe = spec.layers[0].mixer, spec.layers[3].mixer, spec.layers[0].ffn
    assert (gdn.n_k_heads, gdn.n_v_heads, gdn.k_head_dim, gdn.v_head_dim, gdn.conv_kernel) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    assert (attn.n_kv_heads, attn.head_dim, attn.rope.partial) == (hf.num_key_value_heads, hf.head_dim,
                                                                   hf.rope_parameters["partial_rotary_factor"])
    assert (moe.n_experts, moe.top_k, moe.d_expert, moe.d_shared) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.shared_expert_intermediate_size)


@pytest.mark.parametrize("length", [5, 9])
def test_fixed_state_and_cache_equal_transformers_cache_after_a_prefill(length):
    """A tiny random qwen3_next in fp32 on CPU, one prefill of `length` tokens with use_cache: the bytes of the
    linear layers' conv + recurrent state tensors are kvwall's fixed state (the same at both lengths), and the
    attention layers' K/V bytes are kvwall's cache per token x length (state and cache counted in fp32)."""
    import torch

    transformers = _transformers()
    cfg = dict(CONFIGS["qwen3_next"], num_hidden_layers=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, length)), use_cache=True).past_key_values
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
    assert report.fixed_bytes == linear
    assert report.token_bytes * length == attention
    assert report.cache_bytes == linear + attention


def test_one_qwen3_next_80b_layer_by_hand():
    """Qwen3-Next-80B-A3B's linear layer: 16 key heads x 128, 32 value heads x 128, conv kernel 4, hidden 2048.

    key_dim = 16 x 128 = 2048, value_dim = 32 x 128 = 4096, conv_dim = 2 x 2048 + 4096 = 8192.
    state: conv 8192 x 4 = 32,768 + recurrent 32 x 128 x 128 = 524,288 -> 557,056 elements, x 2 B (bf16)
      = 1,114,112 B per sequence; tp=2 halves every head and channel: 557,056 B.
    params: in_proj_qkvz 2048 x (2 x 2048 + 2 x 4096) = 25,165,824; in_proj_ba 2048 x 64 = 131,072;
      conv 8192 x 4 = 32,768; dt_bias + A_log 64; gated norm 128; out_proj 4096 x 2048 = 8,388,608
      -> 33,718,464.
    Its gated attention layer (16 q, 2 kv, head_dim 256): q_proj 2048 x 16 x 256 x 2 = 16,777,216 (the output
    gate doubles it), k and v 2048 x 512 = 1,048,576 each, o 4096 x 2048 = 8,388,608, q/k norms 512
      -> 27,263,488; cache per token 2 x 2 x 256 x 2 B = 2,048 B.
    """
    gdn = GatedDeltaNet(16, 32, 128, 128, 4)
    rules = mixers.of(gdn)
    bf16 = get_format("bf16")
    assert rules.fixed_bytes(gdn, bf16) == 1_114_112
    assert rules.fixed_bytes(gdn, bf16, tp=2) == 557_056
    assert rules.token_bytes(gdn, bf16) == 0 and rules.tokens_held(gdn, 100_000) == 0
    assert gdn.params(2048) == 33_718_464
    attn = Attention(16, 2, 256, 256, qk_norm=True, output_gate=True)
    assert attn.params(2048) == 27_263_488
    assert mixers.of(attn).token_bytes(attn, bf16) == 2_048


def test_the_catalog_model_at_128k():
    """36 linear layers x 1,114,112 B = 40,108,032 B of state; 12 attention layers x 2,048 B = 24,576 B per token,
    x 131,072 tokens = 3,221,225,472 B."""
    from kvwall.spec.resolve import load_spec

    report = memory(load_spec("qwen3-next-80b-a3b"), context=131_072)
    assert (report.fixed_bytes, report.token_bytes) == (40_108_032, 24_576)
    assert report.cache_bytes == 40_108_032 + 3_221_225_472


def test_a_decode_step_reads_and_writes_the_state():
    """One decode step at batch 3 of the 80B layer: the rule's op moves the state in and out (2 x 3 x 1,114,112 B)
    and in_proj reads 2048 x (2 x 2048 + 2 x 4096 + 64) weights."""
    from kvwall.predict.step import Step
    from kvwall.spec.resolve import load_spec

    spec = load_spec("qwen3-next-80b-a3b")
    gdn = spec.layers[0].mixer
    fm = Formats.for_spec(spec)
    ops = {op.name: op for op in mixers.of(gdn).ops(0, gdn, spec, Step(3, 1000, 1), fm, 1, False)}
    assert ops["gated delta rule"].state_bytes == 2 * 3 * 1_114_112
    assert ops["in_proj"].weight_bytes == 2048 * (2 * 2048 + 2 * 4096 + 64) * 2


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["linear_attention"] * 5 + ["sliding_attention"]}, "sliding_attention"),
    ({"layer_types": ["linear_attention"] * 5}, "one type per layer"),
    ({"full_attention_interval": 0}, "full_attention_interval"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
])
def test_what_it_cannot_honour_is_a_clear_error(change, words):
    with pytest.raises(KvwallError, match=words):
        spec_from_config(dict(CONFIGS["qwen3_next"], **change))


def test_tensor_parallel_must_divide_the_heads():
    gdn = GatedDeltaNet(2, 4, 8, 12, 3)
    with pytest.raises(KvwallError, match="key heads"):
        mixers.of(gdn).fixed_bytes(gdn, get_format("bf16"), tp=4)
