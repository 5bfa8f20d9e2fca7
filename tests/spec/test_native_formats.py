"""Weight formats a checkpoint declares in config.json's quantization_config (issue #41): bytes as stored.

Every number here is counted by hand from the layouts (transformers 5.25's quantizers and the checkpoints'
tensors), not recomputed with the code under test.
"""

import json
import subprocess
import sys

import pytest

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.predict.memory import Formats, layer_weight_bytes, memory, total_weight_bytes
from kvwall.spec.formats import native_format, tensor_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.resolve import load_spec

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _cfg(name: str, **extra) -> dict:
    cfg = {k: v for k, v in catalog.load_model_config(name).items() if not k.startswith("_")}
    cfg.pop("quantization_config", None)
    return {**cfg, **extra}


# -- one tensor of each format ---------------------------------------------------------------------------------

def test_fp8_block_one_matrix():
    """A 7168 x 2048 weight (DeepSeek-V3's expert down_proj): 14,680,064 B of e4m3 values + ceil(7168/128) x
    ceil(2048/128) = 56 x 16 = 896 blocks x 4 B (fp32 weight_scale_inv) = 3,584 B."""
    fmt = tensor_format(native_format(FP8, "bfloat16"), "expert", "mlp.experts.down_proj")
    assert fmt.matrix_bytes(7168, 2048) == 14_680_064 + 3_584
    # a ragged edge takes a whole block: 576 x 7168 (kv_a_proj_with_mqa) = 4,128,768 B + 5 x 56 x 4 B
    assert fmt.matrix_bytes(576, 7168) == 4_128_768 + 1_120
    # weight_block_size null: per-tensor scaling, one fp32 scale for the matrix
    per_tensor = native_format({"quant_method": "fp8", "weight_block_size": None}, "bfloat16")
    assert per_tensor.label == "fp8 (per tensor, from quantization_config)"
    assert tensor_format(per_tensor, "linear", "mlp.up_proj").matrix_bytes(7168, 2048) == 14_680_064 + 4


def test_mxfp4_one_expert_matrix():
    """gpt-oss: a 2880 x 2880 expert matrix: 8,294,400 values x 4 bits = 4,147,200 B, plus 8,294,400 / 32 =
    259,200 E8M0 exponents of 1 B."""
    fmt = tensor_format(native_format({"quant_method": "mxfp4"}, "bfloat16"), "expert", "mlp.experts.down_proj")
    assert fmt.matrix_bytes(2880, 2880) == 4_147_200 + 259_200


def test_mxfp4_quantizes_only_the_experts():
    native = native_format({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                 "model.layers.*.mlp.router"]},
                           "bfloat16")
    for kind, name in (("linear", "self_attn.q_proj"), ("router", "mlp.gate"), ("embed", ""), ("head", ""),
                       ("norm", "")):
        assert tensor_format(native, kind, name).label == "bf16"
    # 2880 x 2880 in bf16: 16,588,800 B
    assert tensor_format(native, "linear", "self_attn.o_proj").matrix_bytes(2880, 2880) == 16_588_800


def test_gptq_int4_g128_asym_one_matrix():
    """A 4096 x 4096 Linear, GPTQ 4-bit group 128: qweight 4096 x 4096 / 2 = 8,388,608 B; scales 4096 rows x
    32 groups x 2 B (fp16) = 262,144 B; qzeros 4096 x 32 x 4 bits = 65,536 B; g_idx 4096 x 4 B (int32) =
    16,384 B: 8,732,672 B."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False}
    fmt = tensor_format(native_format(qc, "float16"), "linear", "self_attn.q_proj")
    assert fmt.matrix_bytes(4096, 4096) == 8_388_608 + 262_144 + 65_536 + 16_384
    # modules_in_block_to_quantize: the MLP left out stays fp16 (4096 x 14336 x 2 B = 117,440,512 B)
    only = native_format({**qc, "modules_in_block_to_quantize": [["self_attn.q_proj"], ["self_attn.o_proj"]]},
                         "float16")
    assert tensor_format(only, "linear", "self_attn.o_proj").matrix_bytes(4096, 4096) == 8_732_672
    assert tensor_format(only, "linear", "mlp.down_proj").matrix_bytes(4096, 14336) == 117_440_512


def test_awq_zero_point_and_without():
    """AWQ 4-bit g128, 4096 x 4096: 8,388,608 + 262,144 (fp16 scales) + 65,536 (qzeros) = 8,716,288 B;
    zero_point false drops the zeros: 8,650,752 B. No g_idx."""
    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    assert tensor_format(native_format(qc, "float16"), "linear", "mlp.up_proj").matrix_bytes(4096, 4096) == 8_716_288
    assert native_format(qc, "float16").label == "int4 (awq g128, from quantization_config)"
    qc["zero_point"] = False
    assert tensor_format(native_format(qc, "float16"), "linear", "mlp.up_proj").matrix_bytes(4096, 4096) == 8_650_752


def test_compressed_tensors_int4_group_sym_and_ignore():
    """W4A16 (symmetric, group 128), bf16 scales: 4096 x 4096 = 8,388,608 + 4096 x 32 x 2 = 8,650,752 B;
    the ignored lm_head stays bf16."""
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}
    native = native_format(qc, "bfloat16")
    assert tensor_format(native, "linear", "self_attn.q_proj").matrix_bytes(4096, 4096) == 8_650_752
    assert tensor_format(native, "head").label == "bf16"


# -- DeepSeek-V3: the checkpoint's FP8 is the default ----------------------------------------------------------

def test_deepseek_v3_moe_layer_by_hand():
    """One MoE layer of DeepSeek-V3 (hidden 7168), values 1 B + 4 B per 128 x 128 block:

    attention (FP8): q_a 1536x7168 = 11,010,048 + 12x56x4 = 2,688; q_b 24576x1536 = 37,748,736 + 192x12x4 = 9,216;
    kv_a 576x7168 = 4,128,768 + 5x56x4 = 1,120; kv_b 32768x512 = 16,777,216 + 256x4x4 = 4,096;
    o 7168x16384 = 117,440,512 + 56x128x4 = 28,672: 187,151,072 B. Its q_a/kv_a norms (1536 + 512) bf16: 4,096 B.
    experts (FP8): 256 routed + 1 shared, each gate, up 2048x7168 and down 7168x2048, each 14,680,064 + 3,584:
    257 x 3 x 14,683,648 = 11,321,092,608 B. Router 256x7168 bf16: 3,670,016 B. Two layer norms bf16: 28,672 B.
    Total 11,511,946,464 B.
    """
    spec = load_spec("deepseek-v3")
    fm = Formats.for_spec(spec)
    assert layer_weight_bytes(spec.layers[3], spec, fm.weights) == 11_511_946_464


def test_deepseek_v3_total_fp8_bytes():
    """3 dense layers: attention 187,151,072 + 4,096 + MLP 3 x (132,120,576 + 144x56x4 = 32,256) = 396,458,496
    + norms 28,672 = 583,642,336 each; 58 MoE layers x 11,511,946,464; embed_tokens and lm_head 129280 x 7168 bf16
    = 1,853,358,080 each; final norm 14,336. Sum: 673,150,552,416 B (bf16 sizing said 1,342,052,808,704)."""
    spec = load_spec("deepseek-v3")
    assert spec.layers[0].ffn.kind == "mlp"
    assert memory(spec).weight_bytes == 673_150_552_416
    assert memory(spec, formats=Formats.for_spec(spec, weights="bf16")).weight_bytes == 1_342_052_808_704


def test_default_named_and_override():
    spec = load_spec("deepseek-v3")
    assert Formats.for_spec(spec).as_dict()["weights"] == "fp8 (block 128x128, from quantization_config)"
    over = Formats.for_spec(spec, weights="int4:g128")
    assert over.as_dict()["weights"] == "int4:g128 (from --weight-format)"
    # int4:g128 averages 0.5 + 4 / 128 B on the matrices, embeddings and head bf16 (the old rule)
    assert total_weight_bytes(spec, over.weights) != 673_150_552_416


def test_fit_deepseek_v3_on_8_h200_fits():
    out = subprocess.run([sys.executable, "-m", "kvwall", "fit", "deepseek-v3", "--device", "h200", "--tp", "8",
                          "--context", "32k"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "weights fp8 (block 128x128, from quantization_config)" in out.stdout
    assert "largest batch 18 sequences" in out.stdout


def test_memory_json_names_the_format():
    out = subprocess.run([sys.executable, "-m", "kvwall", "memory", "deepseek-v3", "--json"], capture_output=True,
                         text=True)
    data = json.loads(out.stdout)
    assert data["formats"]["weights"] == "fp8 (block 128x128, from quantization_config)"
    assert data["weight_bytes"] == 673_150_552_416


# -- errors and models without a quantization_config -----------------------------------------------------------

def test_unknown_method_is_one_clear_error_that_an_override_lifts():
    """An unknown method errs when the weights would take its format; --weight-format int4:g128 sizes the same
    model: Llama-3-8B's 6,979,321,856 matrix params x (0.5 + 4 / 128) B = 3,707,764,736 B, its 1,050,673,152 x 2
    embedding + head bytes and 266,240 norm params x 2 B bf16: 5,809,643,520 B."""
    cfg = _cfg("llama-3-8b", quantization_config={"quant_method": "hqq", "nbits": 4})
    spec = spec_from_config(cfg, "x")
    with pytest.raises(KvwallError, match=r"quant_method 'hqq'.*--weight-format"):
        Formats.for_spec(spec)
    over = Formats.for_spec(spec, weights="int4:g128")
    assert over.as_dict()["weights"] == "int4:g128 (from --weight-format)"
    assert memory(spec, formats=over).weight_bytes == 5_809_643_520


def test_bad_block_size_is_an_error():
    with pytest.raises(KvwallError, match="weight_block_size"):
        native_format({"quant_method": "fp8", "weight_block_size": [128]}, "bfloat16")
    spec = spec_from_config(_cfg("llama-3-8b", quantization_config={"quant_method": "fp8",
                                                                  "weight_block_size": [128]}), "x")
    with pytest.raises(KvwallError, match="weight_block_size"):
        memory(spec)


def test_no_quantization_config_is_unchanged():
    """Llama-3-8B, bf16: 8,030,261,248 params x 2 B = 16,060,522,496 B, label plain bf16."""
    spec = load_spec("llama-3-8b")
    assert spec.weight_format is None
    fm = Formats.for_spec(spec)
    assert fm.as_dict()["weights"] == "bf16" and fm.as_dict()["head"] == "bf16"
    assert memory(spec).weight_bytes == 16_060_522_496
    assert Formats.for_spec(spec, weights="int4:g128").as_dict()["weights"] == "int4:g128"


def test_gptq_llama_counts_lm_head_and_embeddings_in_dtype():
    """Llama-3-8B as GPTQ int4 g128 (fp16): each 4096-in matrix of out rows costs out x (2048 + 32 x 2.5) + 4096 x 4
    = out x 2,128 + 16,384; the 14336-in down_proj 4096 x (7168 + 112 x 2.5) + 14336 x 4 = 30,564,352.
    Layer: q, o 4096 rows -> 8,732,672 each; k, v 1024 -> 2,195,456 each; gate, up 14336 -> 30,523,392 each;
    down 30,564,352; norms 2 x 4096 x 2 = 16,384: 113,483,776 B. Embeddings and lm_head 128256 x 4096 x 2 B =
    1,050,673,152 each, final norm 8,192: 32 x 113,483,776 + 2 x 1,050,673,152 + 8,192 = 5,732,835,328 B.
    (GPTQ stores qzeros even when sym, and g_idx whatever desc_act.)"""
    cfg = _cfg("llama-3-8b", torch_dtype="float16",
               quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                    "desc_act": False})
    spec = spec_from_config(cfg, "llama-gptq")
    assert memory(spec).weight_bytes == 5_732_835_328


def test_qwen3_next_fp8_gated_deltanet_and_gated_attention_layers_by_hand():
    """Block-FP8 Qwen3-Next (as its -FP8 release ships): each nn.Linear in e4m3 plus one fp32 scale per 128 x 128
    block; the conv, dt_bias, A_log and the norms stay bf16. hidden 256, key heads 2 x 64 (key_dim 128), value
    heads 4 x 64 (value_dim 256), conv kernel 4, dense MLP 128 on layer 0 (mlp_only_layers)."""
    cfg = dict(model_type="qwen3_next", vocab_size=1000, hidden_size=256, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
               intermediate_size=128, mlp_only_layers=[0, 3], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=128, shared_expert_intermediate_size=128, quantization_config=FP8)
    spec = spec_from_config(cfg)
    w = Formats.for_spec(spec).weights

    def fp8(rows, cols):  # e4m3 values + one fp32 scale per started 128 x 128 block
        return rows * cols + -(-rows // 128) * -(-cols // 128) * 4

    mlp = 2 * fp8(128, 256) + fp8(256, 128)  # gate, up; down
    norms = 2 * 256 * 2  # input and post-attention RMSNorm, bf16
    # layer 0, Gated DeltaNet: in_proj_qkvz (2 x 128 + 2 x 256 = 768 rows), in_proj_ba (2 x 4 rows), out_proj;
    # conv 512 channels x 4 taps, dt_bias and A_log (4 each), the gated norm (64), all bf16
    gdn = fp8(768, 256) + fp8(8, 256) + fp8(256, 256) + (512 * 4 + 8 + 64) * 2
    assert layer_weight_bytes(spec.layers[0], spec, w) == gdn + mlp + norms == 367_856
    # layer 3, gated full attention: q_proj twice as wide (4 x 64 x 2 = 512 rows: queries and the output gate),
    # k and v 2 x 64 rows each, o_proj; q and k norms (64 each) bf16
    attn = fp8(512, 256) + 2 * fp8(128, 256) + fp8(256, 256) + 2 * 64 * 2
    assert layer_weight_bytes(spec.layers[3], spec, w) == attn + mlp + norms
