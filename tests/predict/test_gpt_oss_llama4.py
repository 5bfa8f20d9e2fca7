"""gpt-oss (attention sinks, 128-token windows, biased MoE, MXFP4 experts) and Llama 4 (chunked local attention,
global NoPE layers, MoE with a shared expert, dense layers between, the multimodal wrapper): parsing, weight bytes,
cache and what a decode step reads.

The references are transformers 5.25's own objects (its config classes for defaults and the layer pattern, its
models on the meta device for parameter counts, its cache after a prefill for K/V bytes) and hand arithmetic.
"""

import pytest

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.predict.memory import Formats, memory
from kvwall.predict.step import Step
from kvwall.spec.formats import get_format, tensor_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import Attention

GPT_OSS = dict(model_type="gpt_oss", vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=4)
# MoE on odd layers (interleave 2): dense MLPs of intermediate_size_mlp between; chunk 4, NoPE every 4th layer
LLAMA4_TEXT = dict(model_type="llama4_text", vocab_size=100, hidden_size=64, intermediate_size=32,
                   intermediate_size_mlp=80, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                   attention_chunk_size=4)
VISION = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, image_size=56,
              patch_size=14, vision_output_dim=24, projector_input_dim=24, projector_output_dim=24)
LLAMA4 = dict(model_type="llama4", text_config={k: v for k, v in LLAMA4_TEXT.items() if k != "model_type"},
              vision_config=VISION)


def _transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _meta_params(cfg: dict) -> int:
    """transformers' parameter count of the model a config builds, on the meta device (no memory, no weights)."""
    import torch

    transformers = _transformers()
    hf = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        if cfg["model_type"] == "llama4":
            model = transformers.Llama4ForConditionalGeneration(hf)
        else:
            model = transformers.AutoModelForCausalLM.from_config(hf)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cfg", [GPT_OSS, LLAMA4_TEXT, LLAMA4, dict(LLAMA4, vision_config={})],
                         ids=["gpt_oss", "llama4_text", "llama4", "llama4-default-vision"])
def test_bf16_weight_bytes_equal_transformers_meta_model(cfg):
    """Every parameter transformers counts (sinks, q/k/v/o biases, router and expert biases; the shared expert,
    the dense layers; the vision tower, adapter and projector) is in kvwall's count, and bf16 is 2 bytes each."""
    n = _meta_params(cfg)
    spec = spec_from_config(cfg)
    assert spec.params() == n
    assert memory(spec, formats=Formats.for_spec(spec, weights="bf16")).weight_bytes == 2 * n


def _llama4_pattern(spec):
    """(layer_types, no_rope_layers, moe_layers) as transformers names them, from kvwall's layers."""
    attn = [layer.mixer for layer in spec.layers]
    types = ["chunked_attention" if m.chunk else "full_attention" for m in attn]
    return types, [int(m.rope is not None) for m in attn], [i for i, la in enumerate(spec.layers)
                                                             if la.ffn.kind == "moe"]


@pytest.mark.parametrize("extra", [{}, {"no_rope_layer_interval": 2}, {"no_rope_layers": [0, 1, 1, 0]},
                                   {"moe_layers": [0, 3]}, {"interleave_moe_layer_step": 1},
                                   {"layer_types": ["full_attention"] * 3 + ["chunked_attention"]},
                                   {"attention_chunk_size": None}])
def test_the_llama4_layer_pattern_is_transformers_own(extra):
    """Chunked vs full, RoPE vs NoPE and MoE vs dense per layer: what Llama4TextConfig.__post_init__ derives (or
    keeps) for the same dict; the weightless q/k norm sits on the RoPE layers only (use_qk_norm)."""
    transformers = _transformers()
    cfg = dict(LLAMA4_TEXT, **extra)
    hf = transformers.AutoConfig.for_model(**cfg)
    spec = spec_from_config(cfg)
    assert _llama4_pattern(spec) == (hf.layer_types, hf.no_rope_layers[:4], hf.moe_layers)
    assert [m.l2_qk_norm for m in (la.mixer for la in spec.layers)] == [bool(r) for r in hf.no_rope_layers[:4]]
    chunked = [m.chunk for m in (la.mixer for la in spec.layers) if m.chunk]
    assert chunked == [hf.attention_chunk_size] * len(chunked)


@pytest.mark.parametrize("extra", [{}, {"layer_types": ["full_attention", "sliding_attention"] * 2},
                                   {"num_hidden_layers": 5}])
def test_the_gpt_oss_layer_pattern_is_transformers_own(extra):
    """Sliding (window sliding_window) vs full per layer: transformers' default starts with a sliding layer."""
    transformers = _transformers()
    cfg = dict(GPT_OSS, **extra)
    hf = transformers.AutoConfig.for_model(**cfg)
    spec = spec_from_config(cfg)
    got = ["sliding_attention" if la.mixer.window else "full_attention" for la in spec.layers]
    assert got == hf.layer_types and {la.mixer.window for la in spec.layers} == {None, 4}
    assert all(la.mixer.sinks and la.mixer.qkv_bias and la.mixer.o_bias for la in spec.layers)


@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text"])
def test_missing_fields_take_transformers_defaults(model_type):
    """A config of only model_type: kvwall's sizes are the attributes of transformers' config object."""
    transformers = _transformers()
    hf = transformers.AutoConfig.for_model(model_type)
    spec = spec_from_config({"model_type": model_type})
    a, moe = spec.layers[0].mixer, spec.layers[0].ffn
    assert (spec.hidden, spec.vocab, spec.n_layers, spec.max_context) == (
        hf.hidden_size, hf.vocab_size, hf.num_hidden_layers, hf.max_position_embeddings)
    assert (a.n_q_heads, a.n_kv_heads, a.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (moe.n_experts, moe.top_k, moe.d_expert) == (hf.num_local_experts, hf.num_experts_per_tok,
                                                        hf.intermediate_size)
    assert a.window == getattr(hf, "sliding_window", None) and a.chunk == getattr(hf, "attention_chunk_size", None)


def _prefill(cfg: dict, length: int):
    """A tiny random model in fp32, one prefill of `length` tokens with use_cache: its cache layers."""
    import torch

    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval()
    with torch.no_grad():
        return model(torch.randint(0, 100, (1, length)), use_cache=True).past_key_values.layers


@pytest.mark.parametrize("cfg", [GPT_OSS, LLAMA4_TEXT], ids=["gpt_oss", "llama4_text"])
@pytest.mark.parametrize("length", [2, 3, 9, 10])
def test_cache_equals_transformers_cache_after_a_prefill(cfg, length):
    """Per layer, after a prefill of `length` tokens (window / chunk 4): a full layer holds every token, kvwall's
    per-token bytes x length. A sliding (gpt-oss) or chunked (Llama 4) layer is a sliding-window cache of 4 in
    transformers: it stores the last min(length, 3) tokens, and the next decode step appends its own token before
    attending, min(length + 1, 4): kvwall's tokens held at that step's context, length + 1. Measured both ways:
    the stored tensors' bytes, and the keys update() hands the attention for one more token."""
    import torch

    spec = spec_from_config(cfg)
    fm = Formats.for_spec(spec, kv="fp32")
    rep, step = memory(spec, context=length, formats=fm), memory(spec, context=length + 1, formats=fm)
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    for i, layer in enumerate(_prefill(cfg, length)):
        m = spec.layers[i].mixer
        stored = size(layer.keys) + size(layer.values)
        if m.window or m.chunk:
            assert stored == rep.layers[i].token_bytes * (step.layers[i].tokens_held - 1)
        else:
            assert stored == rep.layers[i].cache_bytes == rep.layers[i].token_bytes * length
        new = torch.zeros(1, m.n_kv_heads, 1, m.head_dim)
        keys, values = layer.update(new, new.clone())
        assert size(keys) + size(values) == step.layers[i].cache_bytes
    assert {m.chunk or m.window for m in (la.mixer for la in spec.layers)} == {None, 4}


def test_one_gpt_oss_120b_layer_and_the_whole_model_by_hand():
    """gpt-oss-120b: hidden 2880, 64 q / 8 kv heads of 64, 128 experts of 2880, biases everywhere.

    attention: q 2880 x 4096 = 11,796,480, k and v 2880 x 512 = 1,474,560 each, o 11,796,480, biases 4096 + 512 +
      512 + 2880 = 8,000, sinks 64 -> 26,550,144. router 128 x 2880 + 128 = 368,768; expert biases 128 x (2 x 2880 +
      2880) = 1,105,920; norms 5,760: 28,030,592 bf16 parameters = 56,061,184 B.
    experts: 128 x 3 matrices x 2880 x 2880 = 3,185,049,600 values in MXFP4, 4 bits + one 8-bit exponent per 32:
      0.53125 B each = 1,692,057,600 B. A layer: 1,748,118,784 B; 36 layers 62,932,276,224 B; embeddings and LM
      head 2 x 201,088 x 2880 x 2 B = 2,316,533,760 B; final norm 5,760 B -> 65,248,815,744 B.
    cache per token: 8 kv heads x (64 + 64) x 2 B = 2,048 B a layer; a sliding layer keeps 128 tokens.
    """
    from kvwall.spec.resolve import load_spec

    spec = load_spec("gpt-oss-120b")
    attn = spec.layers[0].mixer
    assert attn.params(2880) == 26_550_144 and attn.window == 128 and spec.layers[1].mixer.window is None
    assert spec.layers[0].params(2880) - 128 * 3 * 2880 * 2880 == 28_030_592
    fm = Formats.for_spec(spec)
    assert memory(spec, formats=fm).weight_bytes == 65_248_815_744
    rules = mixers.of(attn)
    assert rules.token_bytes(attn, fm.kv) == 2_048
    assert (rules.tokens_held(attn, 100), rules.tokens_held(attn, 100_000)) == (100, 128)


def test_gpt_oss_defaults_to_mxfp4_experts_and_fits_one_80gb_gpu():
    """The checkpoint's quantization_config (mxfp4, modules_to_not_convert: self_attn, router, embeddings, LM head):
    experts MXFP4, the rest bf16. gpt-oss-120b on one H100 (80 GB, 8 GB reserve): 80e9 - 8e9 - 65,248,815,744 =
    6,751,184,256 B for the cache; 18 sliding layers hold 18 x 128 x 2,048 = 4,718,592 B, 18 full layers 36,864 B
    a token: (6,751,184,256 - 4,718,592) // 36,864 = 183,009 tokens, past its 131,072. gpt-oss-20b (24 layers, 32
    experts: 13,761,264,768 B) in 16 GB (1.6 GB reserve): (14.4e9 - 13,761,264,768 - 12 x 128 x 2,048) // 24,576 =
    25,862 tokens."""
    from kvwall import api
    from kvwall.spec.resolve import load_spec

    fmt = Formats.for_spec(load_spec("gpt-oss-120b")).weights
    assert fmt.name == "mxfp4" and fmt.source == "quantization_config"
    assert tensor_format(fmt, "expert", "mlp.experts.down_proj").name == "mxfp4"
    assert tensor_format(fmt, "linear", "self_attn.q_proj").name == "bf16"
    big = api.fit("gpt-oss-120b", device="h100-sxm")
    assert big.weights_fit and big.weights_bytes == 65_248_815_744 and big.max_context == 183_009
    small = api.fit("gpt-oss-20b", memory="16GB")
    assert small.weights_bytes == 13_761_264_768 and small.max_context == 25_862


def test_one_llama4_scout_layer_by_hand():
    """Llama 4 Scout: 40 q / 8 kv heads of 128, hidden 5120, 16 experts of 8192 + a shared expert of 8192.

    attention: q and o 5120 x 5120 = 26,214,400 each, k and v 5120 x 1024 = 5,242,880 each -> 62,914,560 (no norm
    weights: the q/k norm is weightless). MoE: router 5120 x 16 = 81,920; 17 gated MLPs x 3 x 5120 x 8192 =
    2,139,095,040 -> 2,139,176,960; active: router + 2 MLPs = 251,740,160.
    cache: 8 x (128 + 128) x 2 B = 4,096 B a token and layer; at 128k, 36 chunked layers hold 8,192 tokens and 12
    NoPE layers 131,072: (36 x 8,192 + 12 x 131,072) x 4,096 = 7,650,410,496 B.
    """
    from kvwall.spec.resolve import load_spec

    spec = load_spec("llama-4-scout-17b-16e")
    chunked, nope = spec.layers[0].mixer, spec.layers[3].mixer
    assert (chunked.chunk, chunked.rope is not None, nope.chunk, nope.rope) == (8192, True, None, None)
    assert chunked.params(5120) == 62_914_560 and chunked.l2_qk_norm and not nope.l2_qk_norm
    moe = spec.layers[0].ffn
    assert (moe.params(5120), moe.active_params(5120)) == (2_139_176_960, 251_740_160)
    assert memory(spec, context=131_072).cache_bytes == 7_650_410_496
    assert mixers.of(chunked).label(chunked) == "chunked" and spec.family() == "local/global"


def test_a_decode_step_reads_only_its_current_chunk():
    """A chunked layer's decode step at position q reads ((q - 1) mod 8192) + 1 tokens: at context 100,000 that is
    100,000 - 12 x 8,192 = 1,696 tokens x 4,096 B x batch 2; at 16,384 (a chunk's last position) the whole chunk;
    a NoPE layer reads all 100,000. Prefill of 10 tokens with chunk 4 makes 1+2+3+4 + 1+2+3+4 + 1+2 = 23 pairs."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("llama-4-scout-17b-16e")
    fm = Formats.for_spec(spec)
    chunked, nope = spec.layers[0].mixer, spec.layers[3].mixer

    def read(m, context):
        ops = mixers.of(m).ops(0, m, spec, Step(2, context - 1, 1), fm, 1, False)
        return next(op for op in ops if op.name == "attention").cache_read

    assert read(chunked, 100_000) == 2 * 1_696 * 4_096
    assert read(chunked, 16_384) == 2 * 8_192 * 4_096
    assert read(nope, 100_000) == 2 * 100_000 * 4_096
    assert Step(1, 0, 10).chunk_pairs(4) == 23 and Step(1, 0, 10).chunk_held(4) == 10
    assert (Step(1, 6, 1).chunk_pairs(4), Step(1, 6, 1).chunk_held(4)) == (3, 3)


def test_a_chunk_is_not_a_window_for_the_what_ifs():
    """with_window(None) (every token kept, what the engine's full caches size) drops the chunks; with_local_window
    gives the chunked layers the window and leaves the NoPE layers global."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("llama-4-scout-17b-16e")
    full = spec.with_window(None)
    assert all(la.mixer.chunk is None and la.mixer.window is None for la in full.layers)
    assert memory(full, context=131_072).cache_bytes == 48 * 131_072 * 4_096
    local = spec.with_local_window(1024)
    assert [la.mixer.window for la in local.layers[:4]] == [1024, 1024, 1024, None]
    assert all(la.mixer.chunk is None for la in local.layers)
    assert Attention(4, 2, 16, 16, window=8, chunk=4).problems()
    every = spec_from_config(dict(LLAMA4_TEXT, no_rope_layers=[1, 1, 1, 1]))  # no NoPE layer: all chunked
    assert every.family() == "chunked" and spec.family() == "local/global"


@pytest.mark.parametrize("cfg, change, words", [
    (GPT_OSS, {"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
    (GPT_OSS, {"layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
    (GPT_OSS, {"sliding_window": None}, "sliding_window is not set"),
    (GPT_OSS, {"num_local_experts": 0}, "num_local_experts"),
    (LLAMA4_TEXT, {"no_rope_layers": [1, 0]}, "no_rope_layers"),
    (LLAMA4_TEXT, {"layer_types": ["sliding_attention"] * 4}, "sliding_attention"),
    (LLAMA4_TEXT, {"interleave_moe_layer_step": 0}, "interleave_moe_layer_step"),
    (LLAMA4_TEXT, {"moe_layers": [4]}, "moe_layers"),
    (LLAMA4_TEXT, {"attention_chunk_size": 0}, "attention_chunk_size"),
    (LLAMA4_TEXT, {"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_what_it_cannot_honour_is_a_clear_error(cfg, change, words):
    with pytest.raises(KvwallError, match=words):
        spec_from_config(dict(cfg, **change))


def test_tensor_parallel_splits_the_sinks_with_the_heads():
    """Sinks are per query head, so they split with q: a tp=2 shard of a tiny gpt-oss attention holds half of
    every part but K/V (2 kv heads split too): its params / 2."""
    attn = spec_from_config(GPT_OSS).layers[0].mixer
    assert mixers.of(attn).shard_params(attn, 64, 2) == attn.params(64) / 2
    assert mixers.of(attn).token_bytes(attn, get_format("bf16"), tp=2) == 16 * 2 * 2


@pytest.mark.parametrize("past, new", [(0, 10), (6, 1), (7, 1), (8, 1), (5, 7), (13, 1)])
def test_chunk_pairs_and_reads_follow_transformers_chunked_mask(past, new):
    """transformers' chunked causal mask (masking_utils.chunked_causal_mask_function, chunk 4): the (query, key)
    pairs it allows for the new queries are Step.chunk_pairs, and the keys it lets them see, from the first one
    any of them sees to the last, are Step.chunk_held (the tokens a step reads)."""
    import torch

    _transformers()
    from transformers.masking_utils import chunked_causal_mask_function

    mask = chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    allowed = lambda q, k: bool(mask(*(torch.tensor(i) for i in (0, 0, q, k))))  # noqa: E731
    seen = [(q, k) for q in range(past, past + new) for k in range(past + new) if allowed(q, k)]
    step = Step(1, past, new)
    assert step.chunk_pairs(4) == len(seen)
    assert step.chunk_held(4) == past + new - min(k for _, k in seen)


def test_a_gpt_oss_decode_step_reads_bf16_attention_and_mxfp4_experts():
    """One decode step of gpt-oss-120b at batch 1: q/k/v 2880 x (4096 + 2 x 512) and the router 2880 x 128 are
    read in bf16 (2 B), the 4 experts a token touches (128 x (1 - (1 - 4/128)^1) = 4.0) in MXFP4: 4 x 3 x 2880 x
    2880 x 0.53125 B = 52,876,800 B."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("gpt-oss-120b")
    fm = Formats.for_spec(spec)
    layer, st = spec.layers[0], Step(1, 999, 1)
    ops = {op.name: op for op in mixers.of(layer.mixer).ops(0, layer.mixer, spec, st, fm, 1, False)
           + mixers.of(layer.ffn).ops(0, layer.ffn, spec, st, fm, 1)}
    assert ops["qkv_proj"].weight_bytes == 2880 * (4096 + 1024) * 2
    assert ops["o_proj"].weight_bytes == 4096 * 2880 * 2
    assert ops["router"].weight_bytes == 2880 * 128 * 2
    assert ops["experts"].weight_bytes == pytest.approx(52_876_800)
