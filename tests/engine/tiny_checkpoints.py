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


def _configs():
    t = transformers
    return {
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=512, tie_word_embeddings=False,
                                     bos_token_id=None, eos_token_id=None),
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


def make_checkpoint(family: str, path, seed: int = 0, **save_kw):
    cfg = _configs()[family]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(path, **save_kw)
    return model
