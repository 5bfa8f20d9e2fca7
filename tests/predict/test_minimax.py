"""MiniMax-01 (minimax): lightning attention beside softmax GQA, a MoE in every layer.

The references are transformers 5.25's own objects (its config class for defaults and the layer pattern, its model
on the meta device for parameter counts, its MiniMaxCache after a prefill for state and K/V bytes) and hand
arithmetic from MiniMax-Text-01's public architecture.
"""

import pytest

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.predict.memory import Formats, memory
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import Attention, LightningAttention

TINY = dict(model_type="minimax", vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
CONFIGS = {
    "default pattern": TINY,
    # head_dim absent (hidden / heads = 16), experts by their alias, an explicit pattern
    "explicit": dict(model_type="minimax", vocab_size=100, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
                     num_key_value_heads=1, intermediate_size=40, num_experts=3, num_experts_per_tok=1,
                     tie_word_embeddings=True,
                     layer_types=["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 2),
}


def _transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(CONFIGS))
def test_bf16_weight_bytes_equal_transformers_meta_model(variant):
    """transformers builds the model from the same config on the meta device; its parameters x 2 bytes are
    kvwall's bf16 weight bytes."""
    import torch

    transformers = _transformers()
    cfg = CONFIGS[variant]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    n = sum(p.numel() for p in model.parameters())
    spec = spec_from_config(cfg)
    assert spec.params() == n
    assert memory(spec, formats=Formats.for_spec(spec, weights="bf16")).weight_bytes == 2 * n


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_the_layer_pattern_is_transformers_own(variant):
    """transformers' default (softmax on even layers) and an explicit layer_types: kvwall's mixer per layer follows
    the layer_types transformers' config object derives."""
    transformers = _transformers()
    cfg = CONFIGS[variant]
    types = transformers.AutoConfig.for_model(**cfg).layer_types
    got = ["full_attention" if isinstance(layer.mixer, Attention) else "linear_attention"
           for layer in spec_from_config(cfg).layers]
    assert got == types and "linear_attention" in got and "full_attention" in got


def test_missing_fields_take_transformers_defaults():
    transformers = _transformers()
    cfg = dict(model_type="minimax", hidden_size=64, num_hidden_layers=3, num_attention_heads=16)
    hf = transformers.AutoConfig.for_model(**cfg)
    spec = spec_from_config(cfg)
    attn, lightning, moe = spec.layers[0].mixer, spec.layers[1].mixer, spec.layers[0].ffn
    assert (attn.n_kv_heads, attn.head_dim, lightning.head_dim) == (hf.num_key_value_heads, 4, 4)  # 64 / 16
    assert attn.rope.theta == hf.rope_parameters["rope_theta"]
    assert (moe.n_experts, moe.top_k, moe.d_expert) == (hf.num_local_experts, hf.num_experts_per_tok,
                                                        hf.intermediate_size)
    assert (spec.vocab, spec.max_context) == (hf.vocab_size, hf.max_position_embeddings)


def test_the_remote_code_attn_type_list_is_honoured():
    """MiniMax's own checkpoints (remote code) say the pattern as attn_type_list, 0 lightning and 1 softmax."""
    spec = spec_from_config(dict(TINY, attn_type_list=[0, 0, 0, 1]))
    assert [layer.mixer.kind for layer in spec.layers] == ["lightning"] * 3 + ["attention"]
    assert any("attn_type_list" in note for note in spec.notes)


@pytest.mark.slow
@pytest.mark.parametrize("length", [5, 9])
def test_fixed_state_and_cache_equal_transformers_cache_after_a_prefill(length):
    """A tiny random minimax in fp32 on CPU, one prefill of `length` tokens with use_cache: the bytes of the
    MiniMaxCache's linear_cache tensors are kvwall's fixed state (the same at both lengths), and its softmax
    layers' K/V bytes are kvwall's cache per token x length (all counted in fp32)."""
    import torch

    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY)).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, length)), use_cache=True).past_key_values
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    linear = sum(size(t) for t in cache.linear_cache if isinstance(t, torch.Tensor))
    kv = sum(size(layer.keys) + size(layer.values) for layer in cache.layers if layer.keys is not None)
    spec = spec_from_config(TINY)
    report = memory(spec, context=length, formats=Formats.for_spec(spec, kv="fp32", state="fp32"))
    # by hand: 2 lightning layers x 4 heads x 12 x 12 x 4 B; 2 softmax layers x 2 x 2 kv heads x 12 x 4 B per token
    assert report.fixed_bytes == linear == 2 * 4 * 12 * 12 * 4
    assert report.token_bytes * length == kv == 2 * 2 * 2 * 12 * 4 * length
    assert report.cache_bytes == linear + kv


def test_one_minimax_text_01_layer_by_hand():
    """MiniMax-Text-01's lightning layer: 64 heads x 128, hidden 6144 (width 8,192).

    state: 64 x 128 x 128 = 1,048,576 elements x 2 B (bf16) = 2,097,152 B per sequence; tp=8: 262,144 B.
    params: qkv_proj 6144 x 3 x 8192 = 150,994,944; output_gate 6144 x 8192 = 50,331,648; norm 8,192;
      out_proj 8192 x 6144 = 50,331,648 -> 251,666,432; tp=8: 31,458,304.
    Its softmax layer (64 q / 8 kv heads of 128): 2 x 8 x 128 x 2 B = 4,096 B per token.
    """
    la = LightningAttention(64, 128)
    rules = mixers.of(la)
    bf16 = get_format("bf16")
    assert rules.fixed_bytes(la, bf16) == 2_097_152
    assert rules.fixed_bytes(la, bf16, tp=8) == 262_144
    assert rules.token_bytes(la, bf16) == 0 and rules.tokens_held(la, 100_000) == 0
    assert la.params(6144) == 251_666_432
    assert rules.shard_params(la, 6144, 8) == 31_458_304
    attn = Attention(64, 8, 128, 128)
    assert mixers.of(attn).token_bytes(attn, bf16) == 4_096


def test_the_catalog_model_at_128k():
    """70 lightning layers x 2,097,152 B = 146,800,640 B of state; 10 softmax layers x 4,096 B = 40,960 B per token,
    x 131,072 = 5,368,709,120 B. The model page: 456B total, 45.9B activated (without the embedding and LM head,
    2 x 200,064 x 6,144)."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("minimax-text-01")
    report = memory(spec, context=131_072)
    assert (report.fixed_bytes, report.token_bytes) == (146_800_640, 40_960)
    assert report.cache_bytes == 146_800_640 + 5_368_709_120
    assert spec.params() == pytest.approx(456e9, rel=0.005)
    assert spec.active_params() - 2 * 200_064 * 6_144 == pytest.approx(45.9e9, rel=0.005)
    assert any("no published measurement" in note for note in spec.notes)


def test_a_decode_step_reads_and_writes_the_state():
    """One decode step at batch 3 of the Text-01 lightning layer: the recurrence moves the state in and out
    (2 x 3 x 2,097,152 B) and the layer's ops read each of its 251,666,432 weights once (x 2 B)."""
    from kvwall.predict.step import Step
    from kvwall.spec.resolve import load_spec

    spec = load_spec("minimax-text-01")
    la = spec.layers[0].mixer
    ops = mixers.of(la).ops(0, la, spec, Step(3, 1000, 1), Formats.for_spec(spec), 1, False)
    rec = next(op for op in ops if op.name == "lightning recurrence")
    assert rec.state_bytes == 2 * 3 * 2_097_152
    assert sum(op.weight_bytes for op in ops) == 251_666_432 * 2


@pytest.mark.parametrize("change, words", [
    ({"shared_intermediate_size": 16}, "shared_intermediate_size"),
    ({"num_experts": 3}, "name the same field"),
    ({"layer_types": ["linear_attention"] * 3}, "one type per layer"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "sliding_attention"),
    ({"attn_type_list": [0, 2, 0, 1]}, "attn_type_list"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_what_it_cannot_honour_is_a_clear_error(change, words):
    with pytest.raises(KvwallError, match=words):
        spec_from_config(dict(TINY, **change))


def test_tensor_parallel_must_divide_the_heads():
    la = LightningAttention(4, 12)
    with pytest.raises(KvwallError, match="lightning-attention heads"):
        mixers.of(la).fixed_bytes(la, get_format("bf16"), tp=8)


def test_a_layer_in_block_fp8_counted_by_hand():
    """Text-01's layer 0 (lightning + MoE) under a block-wise FP8 quantization_config: each nn.Linear as e4m3
    (1 B a value) + one fp32 scale per 128 x 128 block; the norms and the router in bf16.

    qkv_proj 24576 x 6144: 150,994,944 + 192 x 48 blocks x 4 B = 151,031,808; output_gate 8192 x 6144:
    50,331,648 + 64 x 48 x 4 = 50,343,936; out_proj 6144 x 8192: 50,343,936. Experts 32 x 3 of 9216 x 6144:
    56,623,104 + 72 x 48 x 4 = 56,636,928 each -> 5,437,145,088. bf16: norm 8,192 + router 32 x 6144 = 196,608
    + the two layer norms 12,288 = 217,088 x 2 B = 434,176. Total 5,689,298,944."""
    from kvwall import catalog
    from kvwall.predict.memory import layer_weight_bytes

    cfg = {k: v for k, v in catalog.load_model_config("minimax-text-01").items() if not k.startswith("_")}
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    spec = spec_from_config(cfg)
    assert layer_weight_bytes(spec.layers[0], spec, Formats.for_spec(spec).weights) == 5_689_298_944
