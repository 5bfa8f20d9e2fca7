"""The fused decode step (engine/decode_stack.py, kernels/decode_stack.cpp) against the layer-by-layer fast path and
the eager reference, with every layer feature it takes, float and packed weights, contiguous and paged caches; its
decode steps against a full forward; and the steps it must leave to the layers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


from kvwall.engine import decode_stack  # noqa: E402
from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.caches.base import KVView  # noqa: E402
from kvwall.engine.caches.paged import PagedCache  # noqa: E402
from kvwall.engine.layers.packed import pack_model  # noqa: E402
from kvwall.engine.model import Transformer  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402

MODELS = {
    "llama": {},  # GQA: 4 query heads over 2 KV heads, SwiGLU
    "qwen2": {},  # q, k, v biases
    "gemma3_text": {"head_dim": 12, "query_pre_attn_scalar": 10, "sliding_window": 4},  # (1 + w) norms, q/k norms,
    # sandwich norms, GeGLU (tanh), a sliding window on 5 of every 6 layers and their own rotary table
}


pytestmark = pytest.mark.usefixtures("two_threads")  # conftest.py: 2 threads, as CI has

def model(model_type: str, layers: int = 7, seed: int = 0, **extra) -> Transformer:
    cfg = {"model_type": model_type, "hidden_size": 48, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 40, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-6, **MODELS.get(model_type, {}), **extra}
    torch.manual_seed(seed)
    m = Transformer(spec_from_config(cfg, name="tiny"))
    for p in m.parameters():
        p.data.normal_(0, 0.3)
    return m.set_eager(False)


def decode(m: Transformer, prompt: torch.Tensor, steps: int, cache: str = "contiguous", mode: str = "stack"):
    """Greedy decode after `prompt` (B, T): (logits of each step (B, steps, V), the tokens fed to the steps
    (B, steps), at positions T .. T + steps - 1).
    mode: "stack" (the fused step), "layers" (the fast path layer by layer) or "eager" (the reference)."""
    if mode == "eager":
        m.set_eager(True)
    if mode == "layers":
        m.stack = False  # the stack is built again at the next step once this is None
    B, T = prompt.shape
    c = make_cache(cache, m.spec, B, T + steps + 1)
    with torch.inference_mode():
        nxt = m(prompt, None, c)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        logits, tokens = [], []
        for i in range(steps):
            tokens.append(nxt)
            out = m(nxt, torch.full((B, 1), T + i), c)  # (B, 1, V)
            logits.append(out)
            nxt = out[:, -1].argmax(-1, keepdim=True)
    if mode == "eager":
        m.set_eager(False)
    m.stack = None if mode == "layers" else m.stack
    return torch.cat(logits, 1), torch.cat(tokens, 1)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("batch", [1, 3])
def test_stack_equals_the_layers_and_the_reference(kernel, stacked, model_type, cache, batch):
    m = model(model_type)
    prompt = torch.randint(0, 40, (batch, 5), generator=torch.Generator().manual_seed(batch))
    got = three_ways(m, prompt, cache, stacked)[0]
    assert got.abs().max() > 1  # not a degenerate model


def three_ways(m: Transformer, prompt: torch.Tensor, cache: str, stacked: list):
    """9 greedy steps through the stack (every one of them), layer by layer and eager: equal logits (1e-5 to the
    layers, 1e-4 to the reference) and tokens -> the stack's (logits, tokens)."""
    got, tokens = decode(m, prompt, 9, cache)
    assert stacked and all(stacked), "every decode step went through the stack"
    stacked.clear()
    layers, layer_tokens = decode(m, prompt, 9, cache, "layers")
    eager, eager_tokens = decode(m, prompt, 9, cache, "eager")
    assert not any(stacked)
    torch.testing.assert_close(got, layers, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, layer_tokens) and torch.equal(tokens, eager_tokens)
    return got, tokens


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4:g32", "int8", "q4_1"])
def test_packed_weights_equal_the_layers(kernel, stacked, fmt):
    """Packed projections take packed.h's kernel inside the stack, as PackedLinear does outside it."""
    m = pack_model(model("llama"), get_format(fmt))
    prompt = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(1))
    got, tokens = decode(m, prompt, 8)
    assert all(stacked)
    layers, layer_tokens = decode(m, prompt, 8, mode="layers")
    torch.testing.assert_close(got, layers, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, layer_tokens)


@pytest.mark.parametrize("model_type, cache", [("gemma3_text", "sliding"), ("gemma3_text", "sliding:20"),
                                               ("gemma3_text", "sliding:4:sink2"), ("llama", "sliding:6"),
                                               ("llama", "sliding:3:sink2")])
def test_sliding_caches_in_the_stack(kernel, stacked, model_type, cache):
    """Rings (the model's own window, a what-if one, with sinks) are written and read in place by the stack, equal to
    the layers and to the reference, their slots' positions kept as the layers keep them. sliding:20 covers
    max_len (15), so every layer is contiguous and sees every token: the stack once used Gemma's own window (4)
    there, 6.3 away in the logits from the layers."""
    m = model(model_type)
    prompt = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(7))
    got, tokens = three_ways(m, prompt, cache, stacked)
    if cache == "sliding":  # the model's own windows: exact, so equal to a full forward without a cache
        with torch.inference_mode():
            full = m(torch.cat([prompt, tokens], 1))  # (B, 14, V)
        torch.testing.assert_close(got, full[:, 5:], rtol=1e-4, atol=1e-4)


def test_a_ring_keeps_its_slot_positions(kernel, stacked):
    """After stack steps the ring's positions per slot are those the layers write: a later step taken layer by layer
    (a padding row, a prefill chunk) masks by them."""
    m = model("llama", layers=2)
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(8))
    caches = {}
    for mode in ("stack", "layers"):
        m.stack = None if mode == "stack" else False
        c = caches[mode] = make_cache("sliding:3:sink2", m.spec, 2, 16)
        with torch.inference_mode():
            m(prompt, None, c)
            for i in range(6):
                m(torch.tensor([[1], [2]]), torch.full((2, 1), 5 + i), c)
    m.stack = None
    assert stacked.count(True) == 6
    for a, b in zip(caches["stack"].layers, caches["layers"].layers, strict=True):
        assert torch.equal(a.pos, b.pos) and a.pos[0].tolist() == [0, 1, 8, 9, 10]  # sinks 0, 1; ring 8..10
        torch.testing.assert_close(a.k, b.k, rtol=1e-5, atol=1e-5)


def test_the_stack_follows_changed_weights(kernel, stacked):
    """Built at the first step, the stack is built again after packing or a load: it never runs stale weights."""
    m = model("llama", layers=2)
    prompt = torch.randint(0, 40, (1, 4), generator=torch.Generator().manual_seed(6))
    decode(m, prompt, 2)
    pack_model(m, get_format("int8"))  # new modules
    got, _ = decode(m, prompt, 4)
    torch.testing.assert_close(got, decode(m, prompt, 4, mode="layers")[0], rtol=1e-5, atol=1e-5)
    other = model("llama", layers=2, seed=1)
    m2 = model("llama", layers=2)
    decode(m2, prompt, 2)
    m2.load_state_dict(other.state_dict(), assign=True)  # new parameter objects
    torch.testing.assert_close(decode(m2, prompt, 4)[0], decode(other, prompt, 4)[0], rtol=1e-5, atol=1e-5)
    assert all(stacked)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_decode_steps_equal_a_full_forward(kernel, stacked, model_type):
    """Each step's logits equal a forward over the prompt and the tokens fed, without a cache (T > 1: no stack)."""
    m = model(model_type)
    prompt = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    got, tokens = decode(m, prompt, 10)
    assert all(stacked)
    with torch.inference_mode():
        full = m(torch.cat([prompt, tokens], 1))  # (B, 16, V)
    torch.testing.assert_close(got, full[:, 6:], rtol=1e-4, atol=1e-4)


def test_rows_of_different_lengths_in_a_paged_cache(kernel, stacked):
    """Serving's case: rows at different positions, each adding one token at its end, blocks scattered in the pool;
    equal to the layers over the same pool (and their tokens to the same rows decoded one at a time)."""
    m = model("llama", layers=3)
    lengths = [3, 17, 9]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 40, (n,), generator=g) for n in lengths]

    def run(mode: str):
        m.set_eager(False)
        m.stack = None if mode == "stack" else False
        c = PagedCache(m.spec, batch=3, block_size=4, n_blocks=40)
        order = torch.randperm(40, generator=torch.Generator().manual_seed(4)).tolist()
        c.blocks.free.clear()
        c.blocks.free.extend(order)
        tok = torch.zeros(3, max(lengths), dtype=torch.long)
        pos = torch.full((3, max(lengths)), -1)
        for b, p in enumerate(prompts):  # right-padded prefill
            tok[b, :len(p)], pos[b, :len(p)] = p, torch.arange(len(p))
        with torch.inference_mode():
            out = m(tok, pos, c, last_only=True)[:, -1].argmax(-1, keepdim=True)  # (3, 1)
            steps = []
            for i in range(6):
                at = torch.tensor([[n + i] for n in lengths])  # (3, 1): each row's end
                logits = m(out, at, c)
                assert c.decoding
                steps.append(logits)
                out = logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat(steps, 1)

    got = run("stack")
    assert stacked and all(stacked)
    torch.testing.assert_close(got, run("layers"), rtol=1e-5, atol=1e-5)


def test_steps_the_stack_leaves_to_the_layers(kernel, stacked):
    """Autograd, a row it must not write (padding, at -1), and a model with a layer it does not run (Gemma 2's
    attention softcap) all run layer by layer; fewer attention jobs than threads do not (each is cut along its
    tokens: test_stack_quantized.py's long rows hold the cut to the layers)."""
    m = model("llama", layers=2)
    prompt = torch.randint(0, 40, (1, 4), generator=torch.Generator().manual_seed(5))
    c = make_cache("contiguous", m.spec, 1, 8)
    with torch.inference_mode():
        m(prompt, None, c)
    with torch.enable_grad():  # grad on: the layers, which record a graph
        out = m(torch.tensor([[7]]), torch.tensor([[4]]), c)
    assert out.requires_grad and stacked == [False]
    stacked.clear()
    c = make_cache("contiguous", m.spec, 2, 8)
    with torch.inference_mode():
        m(prompt.expand(2, -1), None, c)
        m(torch.tensor([[7], [0]]), torch.tensor([[4], [-1]]), c)
    assert stacked == [False]
    stacked.clear()
    torch.set_num_threads(4)  # 1 row x 2 KV heads < 4 threads: still the stack
    decode(m, prompt, 3)
    assert stacked and all(stacked)
    gemma2 = model("gemma2", layers=2, head_dim=12, query_pre_attn_scalar=12, attn_logit_softcapping=50.0)
    assert gemma2.spec.layers[0].mixer.softcap
    assert decode_stack.DecodeStack.build(gemma2) is None
    stacked.clear()
    decode(gemma2, prompt, 2)
    assert not stacked


def test_the_stack_checks_its_arguments_before_writing(kernel):
    """A block table entry outside the pool, or a pool of another shape, is an error and nothing is written."""
    m = model("llama", layers=2)
    c = make_cache("contiguous", m.spec, 1, 8)
    with torch.inference_mode():
        m(torch.tensor([[1, 2, 3]]), None, c)
        c.step(torch.tensor([[3]]))
        blocks = c.decode_blocks(1)
        ks, table, lengths, none = [v.k for v in blocks.views], blocks.table, blocks.lengths, decode_stack.NO_COUNTS
        before = [k.clone() for k in ks]
        tables = [rot(torch.tensor([[3]]), torch.float32) for rot in m.rotary]
        cos = [t.cos.reshape(1, -1) for t in tables]
        sin = [t.sin_swapped.reshape(1, -1) for t in tables]
        x = torch.randn(1, 48)
        built = decode_stack.DecodeStack.build(m)
        stack, views = built.stack, [decode_stack.native_view(built.mod, v) for v in blocks.views]
        narrow = [decode_stack.native_view(built.mod, KVView("fp32", v.k[:, :1], v.v)) for v in blocks.views]
        with pytest.raises(RuntimeError, match="outside the pool"):
            stack.step(x.clone(), cos, sin, views, torch.tensor([[5]]), lengths, none)
        with pytest.raises(RuntimeError, match="do not match"):
            stack.step(x.clone(), cos, sin, narrow, table, lengths, none)
        with pytest.raises(RuntimeError, match="outside its block table"):
            stack.step(x.clone(), cos, sin, views, table, torch.tensor([9]), none)
        assert all(torch.equal(a, b) for a, b in zip(ks, before))
