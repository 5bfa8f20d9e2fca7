"""Falcon-H1 (attention and Mamba-2 in parallel in every layer) and LFM2 (short convolutions beside GQA layers):
parsing, weight bytes, fixed state and cache.

The references are transformers 5.25's own objects (its config class for defaults and the layer pattern, its model
on the meta device for parameter counts, its cache after a prefill for state and K/V bytes) and hand arithmetic.
"""

import pytest

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.predict.memory import Formats, memory
from kvwall.predict.step import Step
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import Attention, Mamba2, ParallelHybrid, ShortConv

# head_dim 24 (not 64 / 4 = 16), 2 Mamba groups, every bias and the gated norm on: each one changes the count
FALCON = dict(model_type="falcon_h1", vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, intermediate_size=80, mamba_d_ssm=48, mamba_n_heads=6,
              mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=3, mamba_rms_norm=True, projectors_bias=True,
              attention_bias=True, mlp_bias=True)
LFM2 = dict(model_type="lfm2", vocab_size=100, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, block_ff_dim=200, block_multiple_of=16, conv_L_cache=4, full_attn_idxs=[1, 4])
CONFIGS = {
    "falcon_h1": FALCON,
    # no head_dim, mamba_d_ssm null (expand x hidden = 128), mamba_d_head "auto" (128 / 8), no gated norm, in_proj bias
    "falcon_h1 expand": dict({k: v for k, v in FALCON.items() if k != "head_dim"}, mamba_d_ssm=None, mamba_expand=2,
                             mamba_n_heads=8, mamba_d_head="auto", mamba_rms_norm=False, mamba_proj_bias=True,
                             projectors_bias=False, tie_word_embeddings=True),
    "lfm2": LFM2,
    "lfm2 untied, biased": dict(LFM2, tie_embedding=False, conv_bias=True),
    "lfm2 multiplier": dict(LFM2, block_ffn_dim_multiplier=1.5),
    "lfm2 no adjust": dict({k: v for k, v in LFM2.items() if k != "block_ff_dim"}, block_auto_adjust_ff_dim=False,
                           intermediate_size=72),
    "lfm2 layer_types": dict(LFM2, layer_types=["full_attention", "conv", "conv", "full_attention", "conv"]),
}


def _transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _hf_config(cfg: dict):
    return _transformers().AutoConfig.for_model(**{k: v for k, v in cfg.items() if not k.startswith("_")})


def _meta_params(cfg: dict) -> int:
    import torch

    transformers = _transformers()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(cfg))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_weight_bytes_equal_transformers_meta_model(name):
    """transformers builds the model from the same config on the meta device; its parameters x 2 bytes are
    kvwall's bf16 weight bytes."""
    cfg = CONFIGS[name]
    n = _meta_params(cfg)
    spec = spec_from_config(cfg)
    assert spec.params() == n
    assert memory(spec, formats=Formats.for_spec(spec, weights="bf16")).weight_bytes == 2 * n


@pytest.mark.parametrize("name", ["falcon-h1-34b", "lfm2-1.2b"])
def test_the_catalog_configs_count_what_transformers_builds(name):
    """The real config.json of each catalog model, built by transformers on the meta device: Falcon-H1-34B has
    head_dim 128 where hidden / heads is 256, and LFM2-1.2B's block_ff_dim 12,288 becomes an MLP of 8,192."""
    from kvwall.catalog import load_model_config
    from kvwall.spec.resolve import load_spec

    assert load_spec(name).params() == _meta_params(load_model_config(name))


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("lfm2")] + [
    "lfm2 all attention"])
def test_the_lfm2_layer_pattern_is_transformers_own(name):
    """full_attn_idxs, an explicit layer_types, and neither (every layer attention, as transformers derives it)."""
    cfg = CONFIGS.get(name) or {k: v for k, v in LFM2.items() if k != "full_attn_idxs"}
    types = _hf_config(cfg).layer_types
    got = ["full_attention" if isinstance(layer.mixer, Attention) else "conv" for layer in spec_from_config(cfg).layers]
    assert got == types and "full_attention" in got


def test_every_falcon_h1_layer_is_both():
    """transformers' config says "hybrid" for every layer; each of kvwall's layers holds an attention and a Mamba-2."""
    assert set(_hf_config(FALCON).layers_block_type) == {"hybrid"}
    spec = spec_from_config(FALCON)
    assert all(isinstance(layer.mixer, ParallelHybrid) for layer in spec.layers)
    assert spec.family() == "hybrid" and spec.attention_layers() == [0, 1, 2]


def test_missing_fields_take_transformers_defaults():
    """Configs with only the required fields: kvwall's values are the attributes of transformers' config objects
    for the same dicts (Falcon-H1: 8 KV heads, Mamba-2 width 1024 in 128 heads of 8, d_state 256, 1 group, conv 4;
    LFM2: 8 KV heads, conv_L_cache 3, an MLP of 2/3 x 12,288 = 8,192, tied embeddings)."""
    falcon = dict(model_type="falcon_h1", vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                  intermediate_size=80)
    hf = _hf_config(falcon)
    spec = spec_from_config(falcon)
    a, m = spec.layers[0].mixer.attention, spec.layers[0].mixer.mamba
    assert (a.n_kv_heads, a.head_dim) == (hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads)
    assert (m.n_heads, m.head_dim, m.d_state, m.n_groups, m.d_conv, m.gated_norm) == (
        hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups, hf.mamba_d_conv, hf.mamba_rms_norm)
    assert m.d_inner == hf.mamba_d_ssm and spec.tied_embeddings == hf.tie_word_embeddings
    lfm2 = dict(model_type="lfm2", vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                full_attn_idxs=[1])
    hf = _hf_config(lfm2)
    spec = spec_from_config(lfm2)
    conv, attn = spec.layers[0].mixer, spec.layers[1].mixer
    assert (conv.l_cache, attn.n_kv_heads, spec.tied_embeddings) == (
        hf.conv_L_cache, hf.num_key_value_heads, hf.tie_word_embeddings)
    assert spec.layers[0].ffn.d_ff == 8192


def _cache_bytes(cfg: dict, length: int) -> tuple[int, int]:
    """(conv + recurrent state bytes, K/V bytes) in transformers' cache after a prefill of `length` tokens of a tiny
    random fp32 model on CPU."""
    import torch

    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(cfg)).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, length)), use_cache=True).past_key_values
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = kv = 0
    for layer in cache.layers:
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            state += sum(size(t) for t in states.values() if t is not None)
        if getattr(layer, "keys", None) is not None:
            kv += size(layer.keys) + size(layer.values)
    return state, kv


@pytest.mark.parametrize("cfg", [FALCON, LFM2], ids=["falcon_h1", "lfm2"])
@pytest.mark.parametrize("length", [5, 9])
def test_fixed_state_and_cache_equal_transformers_cache_after_a_prefill(cfg, length):
    """The bytes of the conv (and Mamba-2 SSM) state tensors are kvwall's fixed state, the same at both lengths;
    the K/V bytes are kvwall's cache per token x length (state and cache counted in fp32, the tiny model's)."""
    state, kv = _cache_bytes(cfg, length)
    assert state > 0 and kv > 0
    spec = spec_from_config(cfg)
    report = memory(spec, context=length, formats=Formats.for_spec(spec, kv="fp32", state="fp32"))
    assert report.fixed_bytes == state
    assert report.token_bytes * length == kv
    assert report.cache_bytes == state + kv


def test_one_falcon_h1_34b_layer_by_hand():
    """Falcon-H1-34B: hidden 5120; attention 20 q / 4 kv heads of 128; Mamba-2 32 heads of 128 (4096 wide),
    2 groups, d_state 256, conv 4 with bias, gated norm; MLP 21504.

    attention: q 5120 x 2560 = 13,107,200, k and v 5120 x 512 = 2,621,440 each, o 2560 x 5120 = 13,107,200
      -> 31,457,280; cache per token 4 x (128 + 128) x 2 B = 2,048 B.
    Mamba-2: in_proj 5120 x (2 x 4096 + 2 x 2 x 256 + 32 = 9248) = 47,349,760; conv_dim 4096 + 1024 = 5120:
      conv 5120 x 4 + 5120 = 25,600; dt_bias, A_log, D 96; norm 4096; out_proj 4096 x 5120 = 20,971,520
      -> 68,351,072; state conv 5120 x 4 = 20,480 + SSM 32 x 128 x 256 = 1,048,576 -> 1,069,056 x 2 B = 2,138,112 B.
      tp=2: 16 heads, 1 group each: conv (2048 + 512) x 4 = 10,240 + SSM 524,288 -> 1,069,056 B.
    layer: + MLP 3 x 5120 x 21504 = 330,301,440 + 2 norms of 5120 = 430,120,032.
    """
    from kvwall.spec.resolve import load_spec

    spec = load_spec("falcon-h1-34b")
    layer = spec.layers[0]
    m = layer.mixer
    rules = mixers.of(m)
    bf16 = get_format("bf16")
    assert m.attention.params(5120) == 31_457_280 and m.mamba.params(5120) == 68_351_072
    assert layer.params(5120) == 430_120_032
    assert rules.token_bytes(m, bf16) == 2_048 and rules.tokens_held(m, 100_000) == 100_000
    assert rules.fixed_bytes(m, bf16) == 2_138_112 and rules.fixed_bytes(m, bf16, tp=2) == 1_069_056
    # 72 layers, 2 x 261120 x 5120 embeddings (untied) and the final norm: 33,642,516,224
    assert spec.params() == 72 * 430_120_032 + 2 * 261_120 * 5120 + 5120 == 33_642_516_224


def test_one_lfm2_1_2b_conv_layer_by_hand():
    """LFM2-1.2B's conv layer: hidden 2048, conv_L_cache 3, no bias.

    in_proj 2048 x 3 x 2048 = 12,582,912, conv 2048 x 3 = 6,144, out_proj 2048 x 2048 = 4,194,304 -> 16,783,360;
    state 2048 x 3 x 2 B = 12,288 B per sequence, tp=2: 6,144 B. 10 such layers: 122,880 B; 6 attention layers
    of 8 KV heads x 64: 6 x 8 x 128 x 2 B = 12,288 B per token. MLP: int(2 x 12288 / 3) = 8192, a multiple of 256.
    """
    from kvwall.spec.resolve import load_spec

    conv = ShortConv(2048, 3)
    rules = mixers.of(conv)
    bf16 = get_format("bf16")
    assert conv.params(2048) == 16_783_360
    assert rules.fixed_bytes(conv, bf16) == 12_288 and rules.fixed_bytes(conv, bf16, tp=2) == 6_144
    assert rules.token_bytes(conv, bf16) == 0 and rules.tokens_held(conv, 100_000) == 0
    spec = load_spec("lfm2-1.2b")
    report = memory(spec, context=131_072)
    assert (report.fixed_bytes, report.token_bytes) == (122_880, 12_288)
    assert report.cache_bytes == 122_880 + 12_288 * 131_072
    assert {layer.ffn.d_ff for layer in spec.layers} == {8192}


def test_a_decode_step_reads_and_writes_each_state_and_reads_the_cache():
    """Batch 3 at context 1000: LFM2's short conv moves its state in and out (2 x 3 x 12,288 B) and in_proj reads
    2048 x 6144 bf16 weights; Falcon-H1's layer runs both parts: attention reads 3 x 1000 x 2,048 B of cache,
    the SSD scan moves 2 x 3 x 2,138,112 B of state."""
    from kvwall.spec.resolve import load_spec

    lfm2 = load_spec("lfm2-1.2b")
    conv = lfm2.layers[0].mixer
    ops = {op.name: op for op in mixers.of(conv).ops(0, conv, lfm2, Step(3, 999, 1), Formats.for_spec(lfm2), 1,
                                                     False)}
    assert ops["short conv"].state_bytes == 2 * 3 * 12_288
    assert ops["in_proj"].weight_bytes == 2048 * 6144 * 2
    falcon = load_spec("falcon-h1-34b")
    m = falcon.layers[0].mixer
    ops = {op.name: op for op in mixers.of(m).ops(0, m, falcon, Step(3, 999, 1), Formats.for_spec(falcon), 1, False)}
    assert ops["attention"].cache_read == 3 * 1000 * 2_048
    assert ops["ssd scan"].state_bytes == 2 * 3 * 2_138_112
    assert {"qkv_proj", "o_proj", "in_proj", "out_proj"} <= set(ops)


def test_the_what_ifs_reshape_the_attention_part_of_a_parallel_layer():
    """--window and --kv-heads reach the attention inside Falcon-H1's layers; the Mamba-2 part is left as it is."""
    spec = spec_from_config(FALCON)
    m = spec.with_window(4).with_kv_heads(1).layers[0].mixer
    assert (m.attention.window, m.attention.n_kv_heads, m.mamba) == (4, 1, spec.layers[0].mixer.mamba)
    assert memory(spec.with_window(4), context=100).layers[0].tokens_held == 4
    assert mixers.of(m).label(m) == "sliding+mamba2"


def test_expected_mode_says_it_has_no_measurement_of_these_layers():
    from kvwall.spec.resolve import load_spec

    for name, what in (("falcon-h1-34b", "parallel attention + Mamba-2"), ("lfm2-1.2b", "short-convolution")):
        assert any("no published measurement" in n and what in n for n in load_spec(name).notes)


@pytest.mark.parametrize("cfg, words", [
    (dict(FALCON, mamba_d_head=16), "mamba_d_head 16"),  # 16 x 6 heads is not the width 48
    (dict(FALCON, layers_block_type=["hybrid", "attention", "hybrid"]), "layers_block_type"),
    (dict(FALCON, mamba_n_heads=0), "mamba_n_heads"),
    (dict(LFM2, full_attn_idxs=[1, 7]), r"full_attn_idxs has \[7\]"),
    (dict(LFM2, layer_types=["conv"] * 4 + ["sliding_attention"]), "sliding_attention"),
    (dict(LFM2, layer_types=["conv"] * 4), "one type per layer"),
    (dict(LFM2, conv_L_cache=0), "conv_L_cache"),
    (dict(LFM2, block_ffn_dim_multiplier="big"), "block_ffn_dim_multiplier"),
    (dict(LFM2, block_ffn_dim_multiplier=None), "block_ffn_dim_multiplier is null"),  # transformers refuses it too
])
def test_what_it_cannot_honour_is_a_clear_error(cfg, words):
    with pytest.raises(KvwallError, match=words):
        spec_from_config(cfg)


def test_tensor_parallel_must_divide_the_channels_and_heads():
    conv = ShortConv(2048, 3)
    with pytest.raises(KvwallError, match="short-convolution channels"):
        mixers.of(conv).fixed_bytes(conv, get_format("bf16"), tp=3)
    hybrid = ParallelHybrid(Attention(20, 4, 128, 128), Mamba2(32, 128, 256, 2, 4))
    with pytest.raises(KvwallError, match="20 query heads"):
        mixers.of(hybrid).token_bytes(hybrid, get_format("bf16"), tp=8)


def test_a_decode_step_reads_every_weight_of_the_layer_once():
    """The ops of one decode step stream each of the mixer's parameters once, in bf16: Falcon-H1-34B's parallel
    layer 31,457,280 (attention) + 68,351,072 (Mamba-2) = 99,808,352 x 2 B; LFM2-1.2B's short conv
    16,783,360 x 2 B (hand counts in the by-hand tests above)."""
    from kvwall.spec.resolve import load_spec

    for name, params in (("falcon-h1-34b", 99_808_352), ("lfm2-1.2b", 16_783_360)):
        spec = load_spec(name)
        m = spec.layers[0].mixer
        ops = mixers.of(m).ops(0, m, spec, Step(1, 99, 1), Formats.for_spec(spec), 1, False)
        assert sum(op.weight_bytes for op in ops) == 2 * params
