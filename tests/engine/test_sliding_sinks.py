"""What-if windows and attention sinks (sliding:W, sliding:W:sinkS): the registry's grammar, the bytes by hand,
and decode through the cache equal to a full forward pass whose attention is masked here, eagerly."""

from __future__ import annotations

import pytest

from kvwall.engine.caches.registry import parse_cache, predicted_bytes
from kvwall.errors import KvwallError
from kvwall.spec.model import MLP, Attention, Layer, ModelSpec


@pytest.mark.parametrize("text,window,sink", [
    ("sliding", None, 0), ("sliding:512", 512, 0), ("sliding:1k", 1024, 0), ("sliding:64:sink4", 64, 4),
    ("sliding:sink4", None, 4),
])
def test_sliding_options_parse(text, window, sink):
    choice = parse_cache(text)
    assert (choice.window, choice.sink, choice.text) == (window, sink, text)


@pytest.mark.parametrize("text,message", [
    ("sliding:0", "option '0' not understood; sliding takes :W"), ("sliding:sink0", "option 'sink0' not understood"),
    ("sliding:64:128", "given twice"), ("sliding:64:sink2:sink4", "given twice"), ("sliding:g32", "not understood"),
    ("int4:sink4", "int4 takes :gN"), ("contiguous:64", "contiguous takes no options"),
])
def test_sliding_options_rejected(text, message):
    with pytest.raises(KvwallError, match=message):
        parse_cache(text)


def spec(windows=(None, None, None)):
    """Three GQA layers, 2 KV heads of 16 (K and V: 2 x 2 x 16 x 4 B = 256 B per token per layer in fp32)."""
    return ModelSpec("t", "llama", 32, 50, tuple(Layer(Attention(4, 2, 16, 16, w), MLP(32)) for w in windows))


PER_TOKEN = 2 * 2 * 16 * 4


def test_what_if_bytes_by_hand():
    """No window of its own: W on every layer. Local/global: W replaces the local window only. Sinks add S."""
    plain, local = spec(), spec((None, 8, None))
    assert predicted_bytes("sliding", plain, 2, 100) == 2 * 3 * 100 * PER_TOKEN  # nothing to slide
    assert predicted_bytes("sliding:10", plain, 2, 100) == 2 * 3 * 10 * PER_TOKEN
    assert predicted_bytes("sliding:10:sink4", plain, 2, 100) == 2 * 3 * 14 * PER_TOKEN
    assert predicted_bytes("sliding:10:sink4", plain, 2, 12) == 2 * 3 * 12 * PER_TOKEN  # shorter than W + S
    assert predicted_bytes("sliding:4", local, 2, 100) == 2 * (100 + 4 + 100) * PER_TOKEN
    assert predicted_bytes("sliding:16", local, 2, 100) == 2 * (100 + 16 + 100) * PER_TOKEN  # longer than its own
    assert predicted_bytes("sliding:sink2", local, 2, 100) == 2 * (100 + 10 + 100) * PER_TOKEN


def test_sinks_need_a_window():
    with pytest.raises(KvwallError, match="no sliding window for sinks"):
        predicted_bytes("sliding:sink4", spec(), 1, 100)


# -- decode against an eager masked full forward ---------------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_checkpoints import ids  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.caches.base import NoCache  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402


class MaskedForward(NoCache):
    """A full forward whose attention is softmax(q k^T) v under the mask written out here: a query at i sees
    j <= i with i - j < window[layer] or j < sink (window None: every j <= i)."""

    def __init__(self, windows, sink):
        self.windows, self.sink = windows, sink

    def attend(self, layer, q, k, v, pos, scale, window, softcap, sink=0):
        T, rep = q.shape[2], q.shape[1] // k.shape[1]
        i, j = torch.arange(T)[:, None], torch.arange(T)[None]
        mask = j <= i  # (T, T)
        if self.windows[layer]:
            mask &= (i - j < self.windows[layer]) | (j < self.sink)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, Hq, T, D)
        scores = (q @ k.transpose(-1, -2)) * scale  # (B, Hq, T, T)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # (B, Hq, T, Dv)


def decode_logits(model, tokens, cache_name, prefill):
    """Prefill `prefill` tokens, then one token per step: the logits at every position (B, T, V)."""
    B, T = tokens.shape
    cache = make_cache(cache_name, model.spec, B, T)
    out = [model(tokens[:, :prefill], cache=cache)]
    for t in range(prefill, T):
        out.append(model(tokens[:, t:t + 1], torch.full((B, 1), t), cache))
    return torch.cat(out, 1), cache


# family, cache, the window each layer then attends with, sink
CASES = [("llama", "sliding:8", (8, 8, 8), 0), ("llama", "sliding:8:sink3", (8, 8, 8), 3),
         ("gemma3_text", "sliding:6:sink2", (6, None, 6), 2), ("gemma3_text", "sliding:24", (24, None, 24), 0),
         ("gemma3_text", "sliding", (16, None, 16), 0)]


@pytest.mark.parametrize("prefill", [3, 20])
@pytest.mark.parametrize("family,name,windows,sink", CASES)
def test_decode_equals_the_masked_full_forward(family, name, windows, sink, prefill, checkpoint):
    path, _ = checkpoint(family)
    model = load_model(path)
    tokens = ids(2, 48)
    with torch.no_grad():
        want = model(tokens, cache=MaskedForward(windows, sink))  # (B, T, V)
        got, cache = decode_logits(model, tokens, name, prefill)
    assert (got - want).abs().max().item() < 1e-4
    assert cache.nbytes() == predicted_bytes(name, model.spec, 2, 48)


@pytest.mark.slow
def test_the_window_and_the_sinks_change_the_logits(checkpoint):
    """Not vacuous: on the tiny llama the window and the sinks each move the logits past the tolerance."""
    path, _ = checkpoint("llama")
    model = load_model(path)
    tokens = ids(2, 48)
    with torch.no_grad():
        full = model(tokens)
        window, _ = decode_logits(model, tokens, "sliding:8", 3)
        sinks, _ = decode_logits(model, tokens, "sliding:8:sink3", 3)
    assert (window - full).abs().max().item() > 1e-2 and (sinks - window).abs().max().item() > 1e-2
