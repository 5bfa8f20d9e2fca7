"""Tiny random checkpoints of every family the engine runs, made with transformers (tests import this module)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 160
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
WINDOW = 16  # sliding families: tests run contexts well past it
# DeepSeek MLA + MoE: 8 experts in 4 groups, first layer dense; MLA expands K/V to every head
MLA = dict(COMMON, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
           first_k_dense_replace=1, n_group=4, topk_group=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}

# Hybrids. Jamba: attention on odd layers (no positions), Mamba with dt/B/C norms on even ones, MoE (4 experts,
# top-2, softmax weights unnormalised) on even layers, dense MLPs on odd ones.
JAMBA = dict(COMMON, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
             expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
# Nemotron-H: M Mamba-2, * attention, - relu2 MLP, E MoE (sigmoid routing in 2 groups, relu2 experts + shared)
NEMOTRON_H = dict({k: v for k, v in COMMON.items() if k != "num_hidden_layers"}, hybrid_override_pattern="M*-EM-",
                  head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                  tie_word_embeddings=False)


def _configs():
    t = transformers
    return {
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=512,
                                     tie_word_embeddings=False, bos_token_id=None, eos_token_id=None),
        "llama": lambda: t.LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                               "original_max_position_embeddings": 64},
                                       rope_theta=500.0),
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=WINDOW, head_dim=16),
        "qwen2": lambda: t.Qwen2Config(**COMMON),
        "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=32),
        "gemma3_text": lambda: t.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW,
                                                  layer_types=["sliding_attention", "full_attention",
                                                               "sliding_attention"],
                                                  query_pre_attn_scalar=24, final_logit_softcapping=30.0),
        "phi3": lambda: t.Phi3Config(**COMMON),
        "gemma2": lambda: t.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "mixtral": lambda: t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True),
        "deepseek_v2": lambda: t.DeepseekV2Config(**MLA, q_lora_rank=None, topk_method="group_limited_greedy",
                                                  routed_scaling_factor=1.5, attention_bias=True),
        "deepseek_v3": lambda: t.DeepseekV3Config(**MLA, q_lora_rank=24, rope_parameters=YARN),
        "jamba": lambda: t.JambaConfig(**JAMBA),
        "nemotron_h": lambda: t.NemotronHConfig(**NEMOTRON_H),
    }


FAMILIES = list(_configs())


def randomize(model, seed: int = 0) -> None:
    """Weights large enough that logits are peaked (greedy is stable) and norms far from their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name or "ln" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a persistent buffer that routing reads
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def make_checkpoint(family: str, path, seed: int = 0, config: dict | None = None, **save_kw):
    """A random `family` checkpoint saved at path (config: fields over the tiny config); returns the model."""
    cfg = _configs()[family]()
    for key, value in (config or {}).items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(path, **save_kw)
    return model


def ids(batch: int = 2, length: int = 40, seed: int = 0):
    """Random token ids (batch, length) in the tiny vocabulary."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def transformers_greedy(ref, prompt, new_tokens: int = 32) -> list[int]:
    """transformers' greedy continuation of prompt (1, T): exactly new_tokens ids."""
    with torch.no_grad():
        out = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           do_sample=False, min_new_tokens=new_tokens)
    return out[0, prompt.shape[1]:].tolist()

