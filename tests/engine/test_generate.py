"""The decode loop: sampling, stop tokens, streaming, text through tokenizer.json."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvwall.engine.generate import Sampling, generate, pick  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402

PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint("llama")[0])


def test_sampling_is_repeatable_with_a_seed_and_varies_without(model):
    s = Sampling(temperature=1.5, seed=7)
    a = generate(model, [PROMPT], 24, sampling=s).tokens
    assert a == generate(model, [PROMPT], 24, sampling=s).tokens
    assert a != generate(model, [PROMPT], 24, sampling=Sampling(temperature=1.5, seed=8)).tokens


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    greedy = generate(model, [PROMPT], 16).tokens
    assert generate(model, [PROMPT], 16, sampling=Sampling(temperature=2.0, top_k=1, seed=0)).tokens == greedy
    assert generate(model, [PROMPT], 16, sampling=Sampling(temperature=2.0, top_p=1e-6, seed=0)).tokens == greedy


def test_top_k_and_top_p_only_sample_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2000)
    g = torch.Generator().manual_seed(0)
    assert set(pick(logits, Sampling(1.0, top_k=2), g).tolist()) == {0, 1}
    # softmax of [4, 3, 2, ...]: p0 = 0.64, p0 + p1 = 0.87: top_p 0.8 keeps tokens 0 and 1
    assert set(pick(logits, Sampling(1.0, top_p=0.8), g).tolist()) == {0, 1}


def test_stop_tokens_and_streaming(model):
    full = generate(model, [PROMPT], 20).tokens[0]
    stop = full[5]
    seen = []
    out = generate(model, [PROMPT], 20, stop=(stop,), on_token=lambda row, t: seen.append((row, t)))
    first = full.index(stop)
    assert out.tokens[0] == full[:first + 1]
    assert seen == [(0, t) for t in out.tokens[0]]
    assert out.decode_steps == first


def test_rows_stop_independently(model):
    full = generate(model, [PROMPT, PROMPT[:3]], 12).tokens
    out = generate(model, [PROMPT, PROMPT[:3]], 12, stop=(full[0][2],))
    assert out.tokens[0] == full[0][:full[0].index(full[0][2]) + 1]
    assert out.tokens[1][: len(out.tokens[1])] == full[1][: len(out.tokens[1])]


def test_bad_requests_are_errors(model):
    with pytest.raises(KvwallError, match="outside the vocabulary"):
        generate(model, [[10_000]], 4)
    with pytest.raises(KvwallError, match="at least one token"):
        generate(model, [[]], 4)
    with pytest.raises(KvwallError, match="top-p"):
        generate(model, [PROMPT], 4, sampling=Sampling(1.0, top_p=1.5))
    with pytest.raises(KvwallError, match="unknown cache"):
        generate(model, [PROMPT], 4, cache="fancy")
