"""The architectures `kvwall bench` compares: matched size (121.1-144.5M parameters), random weights.

Every one shares vocab 32,000, hidden 768 and 12 blocks of attention + gated MLP 2,048 (or the SSM
equivalent), so that what differs between them is what they remember per token. Each is a Hugging
Face-style config.json dict, parsed by the same spec parser as any real model.
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB, HIDDEN, LAYERS, FF = 32000, 768, 12, 2048
MAX_POS = 1 << 17

_LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FF,
              num_hidden_layers=LAYERS, num_attention_heads=12, head_dim=64, max_position_embeddings=MAX_POS,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")


@dataclass(frozen=True)
class Arch:
    name: str
    config: dict
    cache: str  # the engine cache it decodes with
    kv_format: str  # the predictor's KV format for the same cache
    about: str
    checkpoint: str | None = None  # a model directory or .gguf file: its own weights instead of random ones

    @property
    def real(self) -> bool:
        """A trained model in a .gguf (a short name or a file): measured against transformers at batch 1 and
        16 (kvwall.measure.real_bench) instead of across contexts."""
        return bool(self.checkpoint) and self.checkpoint.lower().endswith(".gguf")


def _llama(**kw) -> dict:
    return {**_LLAMA, **kw}


def _local_global() -> dict:
    # Gemma-3-style 5 local : 1 global, local window 1,024 tokens
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(LAYERS)]
    return _llama(model_type="mistral", num_key_value_heads=4, sliding_window=1024, layer_types=types)


def _mla(**kw) -> dict:
    """The bench's MLA (mla below): 12 heads, a 256-d latent and a 32-d rope key per token, no query latent."""
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FF, num_hidden_layers=LAYERS,
                num_attention_heads=12, num_key_value_heads=12, kv_lora_rank=256, q_lora_rank=None,
                qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=MAX_POS,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32", **kw)


def _kimi_linear() -> dict:
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)]
    return _mla(model_type="kimi_linear", layer_types=types, mlp_layer_types=["dense"] * LAYERS,
                linear_attn_config=dict(num_heads=12, head_dim=64, short_conv_kernel_size=4),
                pad_token_id=0, bos_token_id=1, eos_token_id=2)  # KimiLinearConfig's defaults lie past 32,000


def _deepseek_v32() -> dict:
    cfg = _mla(model_type="deepseek_v32", first_k_dense_replace=LAYERS, index_n_heads=4, index_head_dim=64,
               index_topk=2048)
    return {**cfg, "q_lora_rank": 384}  # DSA's indexer reads the query latent: deepseek_v32 needs one


ARCHS: dict[str, Arch] = {a.name: a for a in [
    Arch("mha", _llama(num_key_value_heads=12), "contiguous", "fp32", "12 query heads, 12 KV heads"),
    Arch("gqa", _llama(num_key_value_heads=4), "contiguous", "fp32", "12 query heads share 4 KV heads"),
    Arch("mqa", _llama(num_key_value_heads=1), "contiguous", "fp32", "12 query heads share 1 KV head"),
    Arch("sliding", _local_global(), "sliding", "fp32", "GQA-4, 5 local (window 1k) : 1 global layers"),
    Arch("gqa-int8", _llama(num_key_value_heads=4), "int8", "int8", "GQA-4, KIVI int8 cache"),
    Arch("gqa-int4", _llama(num_key_value_heads=4), "int4", "int4", "GQA-4, KIVI int4 cache"),
    Arch("mla", _mla(model_type="deepseek_v2", n_routed_experts=None, first_k_dense_replace=LAYERS),
         "contiguous", "fp32", "latent attention: 256-d latent + 32-d rope key per token (absorbed decode)"),
    Arch("mamba", dict(model_type="mamba", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2 * LAYERS,
                       state_size=16, expand=2, conv_kernel=4, time_step_rank="auto", intermediate_size=2 * HIDDEN,
                       tie_word_embeddings=False, torch_dtype="float32"),
         "contiguous", "fp32", "24 Mamba blocks, d_state 16"),
    Arch("mamba2", dict(model_type="mamba2", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2 * LAYERS,
                        num_heads=24, head_dim=64, state_size=64, n_groups=1, expand=2, conv_kernel=4,
                        tie_word_embeddings=False, torch_dtype="float32"),
         "contiguous", "fp32", "24 Mamba-2 blocks, 24 heads x 64, d_state 64"),
    Arch("hybrid", dict(model_type="jamba", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FF,
                        num_hidden_layers=LAYERS, num_attention_heads=12, num_key_value_heads=4,
                        attn_layer_period=4, attn_layer_offset=3, expert_layer_period=LAYERS + 1,
                        expert_layer_offset=LAYERS, num_experts=1, num_experts_per_tok=1, mamba_d_state=16,
                        mamba_expand=2, mamba_d_conv=4, max_position_embeddings=MAX_POS, tie_word_embeddings=False,
                        torch_dtype="float32"),
         "contiguous", "fp32", "Jamba-style: 1 attention (GQA-4) : 3 Mamba layers, dense MLPs"),
    # Qwen3.5-style: every 4th layer gated full attention (GQA-4, rotary on a quarter of each head), the others
    # Gated DeltaNet with 6 key heads x 64 serving 12 value heads x 64, conv 4 taps
    Arch("gated_deltanet", _llama(model_type="qwen3_5_text", num_key_value_heads=4, full_attention_interval=4,
                                  linear_num_key_heads=6, linear_key_head_dim=64, linear_num_value_heads=12,
                                  linear_value_head_dim=64, linear_conv_kernel_dim=4),
         "contiguous", "fp32", "Qwen3.5-style: 3 Gated DeltaNet (12 heads x 64 x 64) : 1 gated attention (GQA-4)"),
    # Kimi-Linear-style: Kimi Delta Attention (12 heads x 64, per-channel gates, conv 4 taps) on 3 layers of 4, the
    # 4th the bench's NoPE MLA (Kimi Linear's 3 : 1); dense MLPs (Kimi Linear's MoE left out to keep the size matched)
    Arch("kda", _kimi_linear(), "contiguous", "fp32",
         "Kimi-Linear-style: 3 Kimi Delta Attention (12 heads x 64 x 64) : 1 NoPE MLA (256-d latent)"),
    # MiniMax-01-style: lightning attention (12 heads x 64) and softmax GQA-4 layers alternating; its MoE is one
    # expert of 2,048 picked every time, a gated MLP with a router
    Arch("lightning", _llama(model_type="minimax", num_key_value_heads=4, num_local_experts=1, num_experts_per_tok=1),
         "contiguous", "fp32", "MiniMax-style: lightning attention (12 heads x 64 x 64) and GQA-4 layers alternating"),
    # DeepSeek-V3.2-style: the bench's MLA with a query latent of 384 (the indexer reads it), every layer DeepSeek
    # Sparse Attention: a 4-head x 64 lightning indexer keeps a key per token and picks the top 2,048 latents, half
    # of a 4k context and 1/16 of 32k
    Arch("dsa", _deepseek_v32(), "contiguous", "fp32",
         "DeepSeek-V3.2-style: sparse MLA, indexer 4 heads x 64, top 2,048 of the cached latents"),
    # gpt-oss-style: GQA-4 with q/k/v/o biases and a sink logit per head, 128-token windows on even layers and full
    # attention on odd ones; its MoE is one expert of 2,048 (the clamped SwiGLU, biased), picked every time. The
    # sliding cache: a ring of 128 slots on the windowed layers (the contiguous one would keep every token there)
    Arch("sinks", _llama(model_type="gpt_oss", num_key_value_heads=4, sliding_window=128, num_local_experts=1,
                         num_experts_per_tok=1, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
         "sliding", "fp32", "gpt-oss-style: sinks, 128-token windows and full GQA-4 layers alternating"),
    # Llama-4-style: chunked local attention over chunks of 8,192 tokens (Llama 4's) with RoPE on 3 layers of 4, the
    # 4th global NoPE attention over every token; dense MLPs (moe_layers empty). The sliding cache: a ring of one
    # chunk on the chunked layers
    Arch("chunked", _llama(model_type="llama4_text", num_key_value_heads=4, attention_chunk_size=8192,
                           intermediate_size_mlp=FF, moe_layers=[]),
         "sliding", "fp32", "Llama-4-style: 3 chunked (8k chunks, GQA-4) : 1 global NoPE attention"),
    # LFM2-style: short convolutions (3 taps, LFM2's conv_L_cache) with GQA-4 attention at LFM2-1.2B's first four
    # attention positions (layers 2, 5, 8, 10)
    Arch("short_conv", _llama(model_type="lfm2", num_key_value_heads=4, block_ff_dim=FF,
                              block_auto_adjust_ff_dim=False, conv_L_cache=3,
                              layer_types=["full_attention" if i in (2, 5, 8, 10) else "conv" for i in range(LAYERS)]),
         "contiguous", "fp32", "LFM2-style: 8 short-convolution (3 taps) : 4 GQA-4 attention layers"),
    # Falcon-H1-style: every layer GQA-4 attention and Mamba-2 (8 heads x 64, d_state 64) side by side on the same
    # input; the Mamba-2 half is 512 wide so that the 12 layers stay in the matched size (768 wide: 147.2M)
    Arch("parallel_hybrid", _llama(model_type="falcon_h1", num_key_value_heads=4, mamba_d_ssm=512, mamba_n_heads=8,
                                   mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_d_conv=4),
         "contiguous", "fp32", "Falcon-H1-style: GQA-4 attention and Mamba-2 (8 heads x 64) in parallel, every layer"),
]}

DEFAULT = list(ARCHS)
QUICK = ["gqa", "sliding", "gqa-int4", "mamba"]


def checkpoint_arch(path: str) -> Arch:
    """A model directory as a bench architecture: its config, its weights, the contiguous cache in fp32."""
    from pathlib import Path

    from kvwall.spec.resolve import read_config_file

    d = Path(path)
    cfg = read_config_file(d / "config.json")
    return Arch(d.name, cfg, "contiguous", "fp32", f"checkpoint {d}", checkpoint=str(d))


def gguf_arch(name: str) -> Arch:
    """A real model (a short name such as smollm2-135m, or a .gguf file) as a bench architecture."""
    from kvwall.spec.gguf_meta import PACKAGED, config_from_meta, gguf_file, read_meta

    path = gguf_file(name)
    assert path is not None, name
    cfg = config_from_meta(read_meta(path))
    label = name if name in PACKAGED else path.stem  # a file goes by its name, as a model directory does
    return Arch(label, cfg, "contiguous", "fp32", f"{path.name}, dequantized to fp32", checkpoint=str(path))
