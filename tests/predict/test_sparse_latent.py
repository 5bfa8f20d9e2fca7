"""DeepSeek Sparse Attention (deepseek_v32): parsing, weight bytes, cache per token, a decode step, FP8 bytes.

The references are transformers 5.25's own objects (its config class for defaults, its model on the meta device for
parameter counts, its cache after a prefill for the latent and indexer-key bytes), DeepSeek's inference code for the
indexer key format (FP8 e4m3 + one fp32 scale per 128 values) and hand arithmetic on DeepSeek-V3.2's config.
"""

import subprocess
import sys
from dataclasses import replace

import pytest

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.predict.memory import Formats, layer_weight_bytes, memory
from kvwall.predict.step import Step
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import LatentAttention, SparseLatentAttention

# 3 layers: layer 0 dense (first_k_dense_replace 1), layers 1-2 MoE; index_topk 3 is below the prompt lengths
TINY = dict(model_type="deepseek_v32", vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, index_n_heads=2, index_head_dim=8, index_topk=3,
            first_k_dense_replace=1, max_position_embeddings=64)


def _transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"mlp_layer_types": ["sparse", "dense", "sparse"]},
                                   {"first_k_dense_replace": 0, "attention_bias": True}])
def test_bf16_weight_bytes_equal_transformers_meta_model(extra):
    """transformers builds the model from the same config on the meta device; its parameters x 2 bytes are kvwall's
    bf16 weight bytes (the indexer's wq_b, wk, k_norm and weights_proj included)."""
    import torch

    transformers = _transformers()
    cfg = dict(TINY, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    n = sum(p.numel() for p in model.parameters())
    spec = spec_from_config(cfg)
    assert spec.params() == n
    assert memory(spec, formats=Formats.for_spec(spec, weights="bf16")).weight_bytes == 2 * n


@pytest.mark.slow
def test_missing_fields_take_transformers_defaults():
    """A config with only model_type and a few sizes: kvwall's indexer, q_lora_rank and dense/MoE layout are the
    attributes of transformers' config object for the same dict."""
    transformers = _transformers()
    cfg = dict(model_type="deepseek_v32", vocab_size=100, hidden_size=64, num_hidden_layers=5, num_attention_heads=4)
    hf = transformers.AutoConfig.for_model(**cfg)
    spec = spec_from_config(cfg)
    dsa = spec.layers[0].mixer
    assert (dsa.index_n_heads, dsa.index_head_dim, dsa.index_topk, dsa.mla.q_lora_rank, dsa.mla.kv_lora_rank) == (
        hf.index_n_heads, hf.index_head_dim, hf.index_topk, hf.q_lora_rank, hf.kv_lora_rank)
    kinds = ["sparse" if layer.ffn.kind == "moe" else "dense" for layer in spec.layers]
    assert kinds == hf.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("length", [5, 9])
def test_cache_equals_transformers_cache_after_a_prefill(length):
    """A tiny random deepseek_v32 in fp32 on CPU, one prefill of `length` tokens with use_cache: each layer's
    latent (keys: kv_lora_rank, values: the rope key) and indexer keys are kvwall's per-token bytes x length,
    counted as transformers stores them (latent and indexer keys in fp32); every token stays though index_topk is 3.
    With the deployment's indexer format the indexer part is 8 x 1 B + one 4 B scale per token instead."""
    import torch

    transformers = _transformers()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY)).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, length)), use_cache=True).past_key_values
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    latent = sum(size(layer.keys) + size(layer.values) for layer in cache.layers)
    index = sum(size(layer.indexer_keys) for layer in cache.layers)
    assert latent == 3 * length * (16 + 4) * 4 and index == 3 * length * 8 * 4  # the shapes, by hand
    spec = spec_from_config(TINY)
    as_transformers = replace(spec, layers=tuple(
        replace(layer, mixer=replace(layer.mixer, index_keys=get_format("fp32"))) for layer in spec.layers))
    report = memory(as_transformers, context=length, formats=Formats.for_spec(spec, kv="fp32"))
    assert report.token_bytes * length == report.cache_bytes == latent + index
    deployed = memory(spec, context=length, formats=Formats.for_spec(spec, kv="fp32"))
    assert deployed.token_bytes == 3 * ((16 + 4) * 4 + 8 + 4)


def _v32_layer() -> SparseLatentAttention:
    mla = LatentAttention(128, 512, 1536, 128, 64, 128)
    return SparseLatentAttention(mla, 64, 128, 2048)


def test_one_deepseek_v32_layer_by_hand():
    """DeepSeek-V3.2 (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128 / rope 64 / v 128; indexer 64 heads
    x 128, top 2048).

    cache per token: latent 512 + 64 = 576 x 2 B = 1,152 B, indexer key 128 x 1 B + one fp32 scale = 132 B
      -> 1,284 B, on every GPU whatever tp (one latent, one indexer key).
    params: MLA q_a 7168 x 1536 = 11,010,048 + norm 1,536, q_b 1536 x 128 x 192 = 37,748,736, kv_a 7168 x 576
      = 4,128,768 + norm 512, kv_b 512 x 128 x 256 = 16,777,216, o 16384 x 7168 = 117,440,512 -> 187,107,328;
      indexer wq_b 1536 x 8192 = 12,582,912, wk 7168 x 128 = 917,504, k_norm 256, weights_proj 7168 x 64 = 458,752
      -> 13,959,424; layer 201,066,752.
    tp=8: MLA's shared kv_a + norm (4,129,280) on every GPU, the rest / 8: 182,978,048 / 8 = 22,872,256
      -> 27,001,536; the indexer replicated: 40,960,960.
    """
    m = _v32_layer()
    rules = mixers.of(m)
    bf16 = get_format("bf16")
    assert rules.token_bytes(m, bf16) == 1_284 and rules.token_bytes(m, bf16, tp=8) == 1_284
    assert rules.tokens_held(m, 100_000) == 100_000 and rules.fixed_bytes(m, bf16) == 0
    assert m.indexer_params(7168) == 13_959_424
    assert m.params(7168) == 201_066_752
    assert rules.shard_params(m, 7168, 8) == 40_960_960


def test_a_decode_step_reads_every_indexer_key_and_only_the_top_k_latents():
    """One absorbed decode step at context 131,072, batch 1, on the catalog model's layer:
    indexer scores read 131,072 x 132 B = 17,301,504 B and do 2 x 64 heads x (128 + 1) x 131,072 = 2,164,260,864
    FLOPs; the latent attention reads only 2,048 latents x 1,152 B = 2,359,296 B and does
    2 x 128 heads x 2,048 x (576 + 512) = 570,425,344 FLOPs (a dense MLA step would read 131,072 x 1,152 B)."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("deepseek-v3.2")
    m = spec.layers[0].mixer
    fm = Formats.for_spec(spec)
    ops = {op.name: op for op in mixers.of(m).ops(0, m, spec, Step(1, 131_071, 1), fm, 1, True)}
    score, attn = ops["indexer scores (all keys)"], ops["latent attention"]
    assert (score.cache_read, score.flops) == (17_301_504, 2_164_260_864)
    assert (attn.cache_read, attn.flops) == (2_359_296, 570_425_344)


def test_the_fp8_checkpoint_layer_by_hand():
    """Layer 0 (dense MLP) of DeepSeek-V3.2 in its block-wise FP8 (one fp32 scale per 128 x 128 block, ceil on each
    side), each matrix as the checkpoint's tensor listing shapes it:
      q_a [1536, 7168] 11,010,048 + 12 x 56 x 4 = 11,012,736; q_b [24576, 1536] 37,748,736 + 192 x 12 x 4
      = 37,757,952; kv_a [576, 7168] 4,128,768 + 5 x 56 x 4 = 4,129,888; kv_b [32768, 512] 16,777,216 + 256 x 4
      x 4 = 16,781,312; o [7168, 16384] 117,440,512 + 56 x 128 x 4 = 117,469,184; indexer wq_b [8192, 1536]
      12,582,912 + 64 x 12 x 4 = 12,585,984; wk [128, 7168] 917,504 + 1 x 56 x 4 = 917,728; gate and up [18432,
      7168] and down [7168, 18432] 132,120,576 + 144 x 56 x 4 = 132,152,832 each;
      the rest in bf16: q_a / kv_a norms 1,536 + 512, k_norm 256, weights_proj 458,752, two layer norms 14,336
      = 475,392 x 2 B = 950,784.
    Sum: 598,064,064 B."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("deepseek-v3.2")
    assert spec.weight_format.label == "fp8 (block 128x128, from quantization_config)"
    assert spec.layers[0].ffn.kind == "mlp" and spec.layers[3].ffn.kind == "moe"
    assert layer_weight_bytes(spec.layers[0], spec, spec.weight_format) == 598_064_064


def test_fp8_weight_bytes_match_the_checkpoints_tensor_listing():
    """The published DeepSeek-V3.2 checkpoint's tensors add up to 642.12 GiB (a listing of its 163 safetensors files,
    the catalog file's _source). kvwall's FP8 weights plus what it leaves out on purpose give the same: the
    multi-token-prediction layer 61 (one more MoE layer, its own embedding and head 129,280 x 7168 x 2 B each,
    eh_proj 7168 x 14336 x 2 B, three fp32 norms of 7168), the norms the files keep in fp32 rather than bf16
    (+2 B for each of 62 x (2 x 7168 + 1536 + 512 + 256) + 7168 values) and the fp32 e_score_correction_bias
    buffers (59 MoE layers x 256 x 4 B)."""
    from kvwall.spec.resolve import load_spec

    spec = load_spec("deepseek-v3.2")
    weights = memory(spec, formats=Formats.for_spec(spec)).weight_bytes
    mtp = layer_weight_bytes(spec.layers[3], spec, spec.weight_format) + 2 * 129_280 * 7168 * 2 + 7168 * 14336 * 2 \
        + 3 * 7168 * 4
    left_out = mtp + (62 * (2 * 7168 + 1536 + 512 + 256) + 7168) * 2 + 59 * 256 * 4
    assert (weights + left_out) / 2**30 == pytest.approx(642.12, abs=0.005)


def test_the_catalog_model_defaults_to_fp8_and_fits_eight_h200s():
    """fit at 32k on 8 H200s (tp=8): the FP8 weights fit, and the batch is the free bytes over one sequence's cache,
    32,768 tokens x 61 layers x 1,284 B = 2,566,520,832 B per GPU (latent and indexer keys on every GPU)."""
    import json

    out = subprocess.run([sys.executable, "-m", "kvwall", "fit", "deepseek-v3.2", "--device", "h200", "--tp", "8",
                          "--context", "32k", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["formats"]["weights"] == "fp8 (block 128x128, from quantization_config)"
    assert data["weights_fit"] and data["weight_bytes"] < 0.9 * 141e9
    assert data["max_batch"] == data["available_bytes"] // 2_566_520_832 >= 1


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["full_attention"] * 3}, "every deepseek_v32 layer is sparse attention"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"index_head_dim": 2}, "index_head_dim"),
    ({"index_topk": 0}, "index_topk"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
])
def test_what_it_cannot_honour_is_a_clear_error(change, words):
    with pytest.raises(KvwallError, match=words):
        spec_from_config(dict(TINY, **change))


def test_it_is_never_dense_mla():
    """Its own kind, so that nothing that runs "latent" layers (the engine's MLA) takes it for dense MLA; the
    engine runs it with its own mixer (engine/layers/sparse_latent.py, tests/engine/test_deepseek_v32.py)."""
    from kvwall.spec.families import family

    spec = spec_from_config(TINY)
    assert {layer.mixer.kind for layer in spec.layers} == {"sparse_latent"} and not spec.has("latent")
    assert spec.family() == "mla"
    fam = family("deepseek_v32")
    assert fam.runs_in_engine and fam.layout == "llama"
