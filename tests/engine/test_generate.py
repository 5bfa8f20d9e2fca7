"""The decode loop: sampling, stop tokens, streaming, text through tokenizer.json."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvwall.engine.generate import Sampling, generate, greedy, pick  # noqa: E402
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


def test_greedy_is_torch_argmax():
    """numpy's argmax behind greedy() answers as torch.argmax does: the first of tied maxima, a NaN as the largest
    (its first), an all -inf row's index 0, strided views and leading dims, other dtypes through torch."""
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))  # (5, 300)
    x[0, 17] = x[0, 40] = 50.0  # a tie: 17
    x[1, 8] = x[1, 90] = float("nan")  # NaN: 8
    x[2] = float("-inf")  # 0
    x[3, 299] = float("inf")  # 299
    assert greedy(x).tolist() == [17, 8, 0, 299, int(x[4].argmax())]
    for view in (x[:, ::3], x.t().contiguous().t(), x.reshape(5, 3, 100)):
        got = greedy(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(-1))
    with torch.inference_mode():
        y = torch.randn(2, 4, 50)  # (B, T, V) as a model returns it
        assert torch.equal(greedy(y[:, -1]), y[:, -1].argmax(-1))
    assert torch.equal(greedy(x.bfloat16()), x.bfloat16().argmax(-1))
