"""Kimi Linear (kimi_linear): Kimi Delta Attention beside NoPE MLA, dense then MoE layers.

The references are transformers 5.25's own objects (its config class for defaults, aliases and the layer
patterns, its model on the meta device for parameter counts, its cache after a prefill for state and latent
bytes) and hand arithmetic from Kimi-Linear-48B-A3B's public config.
"""

import pytest

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.predict.memory import Formats, memory
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import KimiDeltaAttention, LatentAttention

# the names a saved config.json uses (num_experts, num_experts_per_token, ...), as Kimi's checkpoint spells them
TINY = dict(model_type="kimi_linear", vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64,
            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=12, v_head_dim=10, intermediate_size=80, moe_intermediate_size=24, num_experts=8,
            num_experts_per_token=2, linear_attn_config=dict(num_heads=3, head_dim=8, short_conv_kernel_size=3))
CONFIGS = {
    "saved names": TINY,
    # transformers' attribute names, a q LoRA, biases, two shared experts, two dense layers, top-level linear_*
    "attribute names": dict(model_type="kimi_linear", vocab_size=100, pad_token_id=0, hidden_size=64,
                            num_hidden_layers=5, num_attention_heads=2, kv_lora_rank=8, q_lora_rank=12,
                            qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=6, intermediate_size=48,
                            moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=2,
                            first_k_dense_replace=2, attention_bias=True, linear_num_heads=2, linear_head_dim=6,
                            linear_conv_kernel_dim=2),
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


KDA_LISTS = dict(kda_layers=[1, 2, 4, 6], full_attn_layers=[3, 5])  # 1-based, as the checkpoint writes them
EXPLICIT = ["full_attention", "linear_attention"] * 3


@pytest.mark.parametrize("extra", [{}, {"linear_attn_config": dict(TINY["linear_attn_config"], **KDA_LISTS)},
                                   {"layer_types": EXPLICIT}, {"num_hidden_layers": 9}])
def test_the_layer_pattern_is_transformers_own(extra):
    """The default (every 4th layer from layer 4), the checkpoint's 1-based lists, an explicit layer_types, and a
    longer stack: kvwall's mixer per layer follows the layer_types transformers' config object derives."""
    transformers = _transformers()
    cfg = dict(TINY, **extra)
    types = transformers.AutoConfig.for_model(**cfg).layer_types
    got = ["full_attention" if isinstance(layer.mixer, LatentAttention) else "linear_attention"
           for layer in spec_from_config(cfg).layers]
    assert got == types and "linear_attention" in got and "full_attention" in got


@pytest.mark.parametrize("extra", [{}, {"first_k_dense_replace": 3}, {"first_k_dense_replace": 0},
                                   {"mlp_layer_types": ["sparse", "dense"] * 3}])
def test_the_mlp_pattern_is_transformers_own(extra):
    transformers = _transformers()
    cfg = dict(TINY, **extra)
    kinds = transformers.AutoConfig.for_model(**cfg).mlp_layer_types
    got = ["sparse" if layer.ffn.kind == "moe" else "dense" for layer in spec_from_config(cfg).layers]
    assert got == kinds


def test_missing_fields_take_transformers_defaults():
    """A config of a few fields: kvwall's sizes are the attributes of transformers' config object for it."""
    transformers = _transformers()
    cfg = dict(model_type="kimi_linear", hidden_size=64, num_hidden_layers=5)
    hf = transformers.AutoConfig.for_model(**cfg)
    spec = spec_from_config(cfg)
    kda, mla, moe = spec.layers[0].mixer, spec.layers[4].mixer, spec.layers[1].ffn
    assert (kda.n_heads, kda.head_dim, kda.conv_kernel) == (hf.linear_num_heads, hf.linear_head_dim,
                                                            hf.linear_conv_kernel_dim)
    assert (mla.n_heads, mla.kv_lora_rank, mla.q_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim) == (hf.num_attention_heads, hf.kv_lora_rank, hf.q_lora_rank, hf.qk_nope_head_dim,
                                hf.qk_rope_head_dim, hf.v_head_dim)
    assert mla.rope is None  # NoPE: transformers' KimiLinearAttention rotates nothing
    assert (moe.n_experts, moe.top_k, moe.d_expert, moe.d_shared) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
        hf.moe_intermediate_size * hf.n_shared_experts)
    assert (moe.routing.scale, moe.routing.normalize) == (hf.routed_scaling_factor, hf.norm_topk_prob)
    assert (spec.vocab, spec.max_context, spec.layers[0].ffn.d_ff) == (hf.vocab_size, hf.max_position_embeddings,
                                                                        hf.intermediate_size)


@pytest.mark.slow
@pytest.mark.parametrize("length", [5, 9])
def test_fixed_state_and_cache_equal_transformers_cache_after_a_prefill(length):
    """A tiny random kimi_linear in fp32 on CPU, one prefill of `length` tokens with use_cache: the bytes of the
    KDA layers' conv + recurrent state tensors are kvwall's fixed state (the same at both lengths), and the MLA
    layer's cached latent + rope key bytes are kvwall's cache per token x length (all counted in fp32)."""
    import torch

    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY)).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, length)), use_cache=True).past_key_values
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    linear = latent = 0
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            linear += sum(size(t) for t in layer.conv_states.values()) + sum(
                size(t) for t in layer.recurrent_states.values())
        else:
            latent += size(layer.keys) + size(layer.values)
    assert linear > 0 and latent > 0
    spec = spec_from_config(TINY)
    report = memory(spec, context=length, formats=Formats.for_spec(spec, kv="fp32", state="fp32"))
    # by hand: 5 KDA layers x (conv 72 x 3 + recurrent 3 x 8 x 8) x 4 B; 1 MLA layer x (16 + 8) x 4 B per token
    assert report.fixed_bytes == linear == 5 * (72 * 3 + 3 * 8 * 8) * 4
    assert report.token_bytes * length == latent == (16 + 8) * 4 * length
    assert report.cache_bytes == linear + latent


def test_one_kimi_linear_48b_layer_by_hand():
    """Kimi-Linear-48B-A3B's KDA layer: 32 heads x 128, conv kernel 4, hidden 2304.

    qkv_dim = 32 x 128 = 4,096, conv_dim = 3 x 4,096 = 12,288.
    state: conv 12,288 x 4 = 49,152 + recurrent 32 x 128 x 128 = 524,288 -> 573,440 elements, x 2 B (bf16)
      = 1,146,880 B per sequence; tp=4 splits every head and channel: 286,720 B.
    params: q/k/v 3 x 2304 x 4096 = 28,311,552; conv 12,288 x 4 = 49,152; f_a 2304 x 128 = 294,912,
      f_b 128 x 4096 = 524,288, dt_bias 4,096, A_log 32; b_proj 2304 x 32 = 73,728; g_a 294,912, g_b 524,288;
      o_norm 128; o_proj 4096 x 2304 = 9,437,184 -> 39,514,272.
    tp=4: f_a, g_a and o_norm stay whole (294,912 x 2 + 128 = 589,952), the rest splits:
      (39,514,272 - 589,952) / 4 + 589,952 = 10,321,032.
    Its MLA layer (32 heads, no q LoRA, latent 512 + rope 64): cache (512 + 64) x 2 B = 1,152 B per token.
    """
    kda = KimiDeltaAttention(32, 128, 4)
    rules = mixers.of(kda)
    bf16 = get_format("bf16")
    assert rules.fixed_bytes(kda, bf16) == 1_146_880
    assert rules.fixed_bytes(kda, bf16, tp=4) == 286_720
    assert rules.token_bytes(kda, bf16) == 0 and rules.tokens_held(kda, 100_000) == 0
    assert kda.params(2304) == 39_514_272
    assert rules.shard_params(kda, 2304, 4) == 10_321_032
    mla = LatentAttention(32, 512, None, 128, 64, 128)
    assert mixers.of(mla).token_bytes(mla, bf16) == 1_152


def test_the_catalog_model_at_128k():
    """20 KDA layers x 1,146,880 B = 22,937,600 B of state; 7 MLA layers x 1,152 B = 8,064 B per token,
    x 131,072 tokens = 1,056,964,608 B. 48B total / 3B activated per token on the model card: 49.12B counted,
    2.73B active without the embedding and LM head (2 x 163,840 x 2,304)."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("kimi-linear-48b-a3b")
    report = memory(spec, context=131_072)
    assert (report.fixed_bytes, report.token_bytes) == (22_937_600, 8_064)
    assert report.cache_bytes == 22_937_600 + 1_056_964_608
    assert spec.params() == pytest.approx(48e9, rel=0.03)
    assert spec.active_params() - 2 * 163_840 * 2_304 == pytest.approx(3e9, rel=0.1)
    assert spec.max_context == 1_048_576  # model_max_length, transformers' alias of max_position_embeddings
    assert any("no published measurement" in note for note in spec.notes)


def test_a_decode_step_reads_and_writes_the_state():
    """One decode step at batch 3 of the 48B KDA layer: the rule moves the state in and out (2 x 3 x 1,146,880 B),
    and the layer's ops read each of its 39,514,272 weights once (x 2 B)."""
    from kvwall.predict.step import Step
    from kvwall.spec.resolve import load_spec

    spec = load_spec("kimi-linear-48b-a3b")
    kda = spec.layers[0].mixer
    ops = mixers.of(kda).ops(0, kda, spec, Step(3, 1000, 1), Formats.for_spec(spec), 1, False)
    rule = next(op for op in ops if op.name == "kimi delta rule")
    assert rule.state_bytes == 2 * 3 * 1_146_880
    assert sum(op.weight_bytes for op in ops) == 39_514_272 * 2


@pytest.mark.parametrize("change, words", [
    ({"linear_attn_config": dict(TINY["linear_attn_config"], kda_layers=[1, 2, 4, 6])}, "not the other"),
    ({"linear_attn_config": dict(TINY["linear_attn_config"], kda_layers=[1, 2, 3, 6], full_attn_layers=[3, 5])},
     "twice or outside"),
    ({"linear_attn_config": dict(TINY["linear_attn_config"], kda_layers=[1, 2, 4], full_attn_layers=[3, 5])},
     "names no type for layer"),
    ({"linear_attn_config": dict(TINY["linear_attn_config"], num_heads=0)}, "num_heads"),
    ({"linear_attn_config": dict(TINY["linear_attn_config"], use_full_rank_gate=True)}, "use_full_rank_gate"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"num_local_experts": 4}, "name the same field"),
    ({"layer_types": ["linear_attention"] * 5 + ["sliding_attention"]}, "sliding_attention"),
    ({"mlp_layer_types": ["dense"] * 5}, "mlp_layer_types"),
])
def test_what_it_cannot_honour_is_a_clear_error(change, words):
    with pytest.raises(KvwallError, match=words):
        spec_from_config(dict(TINY, **change))


def test_tensor_parallel_must_divide_the_heads():
    kda = KimiDeltaAttention(3, 8, 3)
    with pytest.raises(KvwallError, match="KDA heads"):
        mixers.of(kda).fixed_bytes(kda, get_format("bf16"), tp=2)


def test_a_layer_in_block_fp8_counted_by_hand():
    """The 48B's layer 0 (KDA + the dense MLP) under a block-wise FP8 quantization_config: each nn.Linear as e4m3
    (1 B a value) + one fp32 scale per 128 x 128 block, the rest in bf16.

    q/k/v 4096 x 2304: 9,437,184 + 32 x 18 blocks x 4 B = 9,439,488 each; b_proj 32 x 2304: 73,728 + 18 x 4 = 73,800;
    f_a, g_a 128 x 2304: 294,912 + 72 = 294,984 each; f_b, g_b 4096 x 128: 524,288 + 32 x 4 = 524,416 each;
    o_proj 2304 x 4096: 9,439,488 -> 39,470,552. MLP gate/up/down 9216 x 2304: 21,233,664 + 72 x 18 x 4
    = 21,238,848 each -> 63,716,544. bf16: conv 49,152 + dt_bias 4,096 + A_log 32 + o_norm 128 + the two layer
    norms 4,608 = 58,016 x 2 B = 116,032. Total 103,303,128."""
    from kvwall import catalog
    from kvwall.predict.memory import layer_weight_bytes

    cfg = {k: v for k, v in catalog.load_model_config("kimi-linear-48b-a3b").items() if not k.startswith("_")}
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    spec = spec_from_config(cfg)
    assert layer_weight_bytes(spec.layers[0], spec, Formats.for_spec(spec).weights) == 103_303_128
