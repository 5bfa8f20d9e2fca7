"""The checks every family's engine test makes against transformers 5.25 (issue #42): test modules import this.

Each check takes a checkpoint made by `save` (a transformers config with tiny sizes, a model with a fixed seed and
randomize's peaked weights, save_pretrained) and the transformers model it was saved from.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_checkpoints import VOCAB, ids, randomize, transformers_greedy  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.predict.memory import Formats, memory  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402

TOLERANCE = 1e-4  # the logits tolerance of test_models.py
FP32 = Formats(get_format("fp32"), get_format("fp32"), get_format("fp32"))  # weights, KV and state in fp32
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


def made(tmp_path_factory, name: str, config):
    """(path, transformers model, engine model) of a checkpoint of `config` saved under a fresh temp dir `name`."""
    path = tmp_path_factory.mktemp(name)
    ref = save(config, path)
    return path, ref, load_model(path)


def decode_logits(model, x, cache: str = "contiguous", dtype=None, **knobs):
    """Prefill 5 tokens, a chunk of 7 on top of the cache, then one token at a time -> the steps' logits (B, T, V)
    in one tensor. `dtype`: the cache's (default fp32); `knobs`: make_cache's (block_size 4 unless given)."""
    B, T = x.shape
    kw = dict(dict(block_size=4), **knobs) | ({} if dtype is None else {"dtype": dtype})
    with torch.no_grad():
        c = make_cache(cache, model.spec, B, T, **kw)
        steps = [model(x[:, :5], None, c), model(x[:, 5:12], torch.arange(5, 12).expand(B, 7), c)]
        steps += [model(x[:, t:t + 1], torch.full((B, 1), t), c) for t in range(12, T)]
    return torch.cat(steps, 1)


def decode_error(path, cache: str = "contiguous", length: int = 40) -> float:
    """decode_logits' largest |logit difference| from one full forward over the same 2 x length tokens."""
    model = load_model(path)
    x = ids(length=length)
    with torch.no_grad():
        full = model(x)
    return (decode_logits(model, x, cache) - full).abs().max().item()


def filled_cache(model, batch: int, length: int):
    """A contiguous cache of `model` after a prefill of length - 3 random tokens and 3 decode steps."""
    cache = make_cache("contiguous", model.spec, batch, length)
    x = ids(batch, length)
    with torch.no_grad():
        model(x[:, :length - 3], None, cache)
        for t in range(length - 3, length):
            model(x[:, t:t + 1], torch.full((batch, 1), t), cache)
    return cache


def greedy_pair(model, ref, new_tokens: int = 20) -> tuple[list[int], list[int]]:
    """(the engine's, transformers') greedy continuation of one 12-token prompt (seed 1)."""
    prompt = ids(batch=1, length=12, seed=1)
    expected = transformers_greedy(ref, prompt, new_tokens=new_tokens)
    return generate(model, [prompt[0].tolist()], max_new_tokens=new_tokens).tokens[0], expected


def greedy_batch_alone_transformers(model, ref, lengths=(3, 21, 9), new_tokens: int = 20):
    """Greedy continuations of prompts of `lengths`: (the engine's as one right-padded batch, the engine's one prompt
    at a time, transformers' one prompt at a time)."""
    prompts = [ids(1, n, seed=n)[0].tolist() for n in lengths]
    batch = generate(model, prompts, max_new_tokens=new_tokens).tokens
    alone = [generate(model, [p], max_new_tokens=new_tokens).tokens[0] for p in prompts]
    return batch, alone, [transformers_greedy(ref, torch.tensor([p]), new_tokens=new_tokens) for p in prompts]


def verify_and_generate(path, spec, capsys, prompt: int = 6, context_bytes=None) -> None:
    """`kvwall verify` passes on `prompt` tokens and `kvwall generate` gives 8 ids of the vocabulary after 3 (6 when
    prompt > 6), reporting the cache bytes context_bytes(tokens) (default: the predictor's at fp32)."""
    from kvwall.cli import main

    assert main(["verify", str(path), "--json", "--prompt-ids", ",".join(str(i) for i in range(1, prompt + 1))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass"] and out["tokens"] == prompt
    given = 6 if prompt > 6 else 3
    assert main(["generate", str(path), "--prompt-ids", ",".join(str(i) for i in range(1, given + 1)),
                 "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ids"]) == 8 and all(0 <= i < VOCAB for i in out["ids"])
    tokens = given + 8
    want = context_bytes(tokens) if context_bytes else memory(spec, batch=1, context=tokens, formats=FP32).cache_bytes
    assert out["cache_bytes"] == want


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
