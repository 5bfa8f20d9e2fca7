"""The checks every family's engine test makes against transformers 5.25 (issue #42): test modules import this.

Each check takes a checkpoint made by `save` (a transformers config with tiny sizes, a model with a fixed seed and
randomize's peaked weights, save_pretrained) and the transformers model it was saved from.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_checkpoints import VOCAB, ids, randomize, transformers_greedy  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402

TOLERANCE = 1e-4  # the logits tolerance of test_models.py
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save(config, path, seed: int = 0):
    """A random checkpoint of `config` saved at path; returns the transformers model (eager attention)."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(ref, seed)
    ref.save_pretrained(path)
    return ref


def full_forward_error(path, ref, length: int = 40) -> float:
    """Largest |logit difference| of one full forward over 2 x length random tokens, engine vs transformers."""
    model = load_model(path)
    x = ids(length=length)
    with torch.no_grad():
        return (model(x) - ref(x).logits).abs().max().item()


def decode_error(path, cache: str = "contiguous", length: int = 40) -> float:
    """Prefill 5 tokens, a chunk of 7 on top of the cache, then one token at a time: the largest |logit difference|
    from one full forward over the same 2 x length tokens."""
    model = load_model(path)
    x = ids(length=length)
    B, T = x.shape
    with torch.no_grad():
        full = model(x)
        c = make_cache(cache, model.spec, B, T, block_size=4)
        steps = [model(x[:, :5], None, c), model(x[:, 5:12], torch.arange(5, 12).expand(B, 7), c)]
        steps += [model(x[:, t:t + 1], torch.full((B, 1), t), c) for t in range(12, T)]
    return (torch.cat(steps, 1) - full).abs().max().item()


def greedy_pairs(path, ref, lengths=(12,), new_tokens: int = 20, cache: str = "contiguous"):
    """(engine, transformers) greedy continuations of prompts of `lengths`, the engine's run as one right-padded
    batch; transformers' one prompt at a time."""
    model = load_model(path)
    prompts = [ids(1, n, seed=n)[0] for n in lengths]
    got = generate(model, [p.tolist() for p in prompts], max_new_tokens=new_tokens, cache=cache).tokens
    return [(g, transformers_greedy(ref, p[None], new_tokens)) for g, p in zip(got, prompts)]


def catalog_params(name: str) -> tuple[int, int]:
    """(parameters of the engine model built on the meta device, the predictor's count) for a catalog model."""
    import json
    from importlib import resources

    from kvwall.engine.model import Transformer
    from kvwall.spec.hf import spec_from_config

    config = json.loads((resources.files("kvwall.catalog") / "models" / f"{name}.json").read_text())
    spec = spec_from_config(config, name=name)
    with torch.device("meta"):
        model = Transformer(spec)
    return sum(p.numel() for p in model.parameters()), spec.params()
