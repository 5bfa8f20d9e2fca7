"""Projections in oneDNN's layout (engine/layers/onednn.py) against F.linear over the plain matrix, and the model
around them: loaded models use it, the eager path swaps back bit for bit, state dicts and bytes are unchanged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from tiny_checkpoints import ids  # noqa: E402
from torch import nn  # noqa: E402

from kvwall.engine.layers.onednn import OneDnnLinear, available  # noqa: E402
from kvwall.engine.layers.packed import PackedLinear, pack_model, weight_bytes  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.engine.model import projections  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402

needs_onednn = pytest.mark.skipif(not available(torch.float32), reason="torch built without oneDNN (mkldnn)")


def _linear(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (16, 96), (2, 5, 96)])  # a decode row, a batch, (B, T, K)
def test_onednn_linear_equals_f_linear(bias, shape):
    """Within 1e-5 of F.linear on the same matrix (oneDNN sums each dot product in its own order)."""
    lin = _linear(200, 96, bias)
    x = torch.randn(*shape)
    want = F.linear(x, lin.weight, lin.bias)  # (..., 200)
    got = OneDnnLinear.from_linear(lin)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_strided_input_gives_the_same_product():
    """Attention's output and the MLP's split halves reach the projection as views, not contiguous copies."""
    lin = _linear(64, 32, bias=False)
    wide = torch.randn(3, 4, 64)
    x = wide[..., :32]  # (3, 4, 32), rows 64 apart
    torch.testing.assert_close(OneDnnLinear.from_linear(lin)(x), F.linear(x.contiguous(), lin.weight),
                               rtol=1e-5, atol=1e-5)


@needs_onednn
def test_the_matrix_round_trips_exactly():
    lin = _linear(48, 80, bias=True)
    one = OneDnnLinear.from_linear(lin)
    assert torch.equal(one.dense_weight(), lin.weight.detach())
    back = one.linear()
    assert isinstance(back, nn.Linear) and torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)
    assert one.weight_bytes() == 48 * 80 * 4
    assert not hasattr(one, "weight")  # writing `.weight` in place would change a copy: there is none to write


@needs_onednn
def test_a_state_dict_holds_plain_weights_and_loads_back():
    lin = _linear(16, 24, bias=True)
    one = OneDnnLinear.from_linear(lin)
    state = one.state_dict()
    assert set(state) == {"weight", "bias"} and torch.equal(state["weight"], lin.weight.detach())
    other = OneDnnLinear.from_linear(_linear(16, 24, bias=True, seed=1))
    other.load_state_dict(state)
    assert torch.equal(other.dense_weight(), lin.weight.detach())
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict({"bias": state["bias"]})


@needs_onednn
def test_a_loaded_model_holds_its_projections_in_onednn_layout_and_eager_swaps_back(checkpoint):
    path, _ = checkpoint("llama")
    model = load_model(path)
    lins = projections(model)
    assert len(lins) == 4 * model.spec.n_layers + 1  # wqkv, wo, w13, w2 of every layer, and the untied head
    assert all(isinstance(lin, OneDnnLinear) for lin in lins)
    fast_state = model.state_dict()
    model.set_eager(True)
    plain = projections(model)
    assert all(type(lin) is nn.Linear and lin.weight.is_contiguous() for lin in plain)
    eager_state = model.state_dict()
    assert set(fast_state) == set(eager_state)
    assert all(torch.equal(fast_state[k], eager_state[k]) for k in eager_state)
    model.set_eager(False)  # and back: the flag from load_model stays
    assert all(isinstance(lin, OneDnnLinear) for lin in projections(model))


@needs_onednn
def test_the_bytes_held_are_the_float_bytes(checkpoint):
    """4 bytes a weight: the same count with the projections in oneDNN's layout as with plain nn.Linear."""
    path, _ = checkpoint("llama")
    model = load_model(path)
    spec = model.spec
    fast = weight_bytes(model)
    assert fast == weight_bytes(model.set_eager(True))
    assert fast == 4 * sum(p.numel() for p in model.parameters())  # the eager model's params, all fp32
    assert spec.params() * 4 == fast  # the spec's own count (config arithmetic, not the module tree)


@needs_onednn
def test_packing_a_prepacked_model_equals_packing_a_plain_one(checkpoint):
    path, _ = checkpoint("llama")
    a = pack_model(load_model(path), get_format("int8"))  # from OneDnnLinear projections
    b = pack_model(load_model(path).set_eager(True), get_format("int8"))  # from plain nn.Linear
    pa = [m for m in a.modules() if isinstance(m, PackedLinear)]
    pb = [m for m in b.modules() if isinstance(m, PackedLinear)]
    assert len(pa) == len(pb) == 4 * a.spec.n_layers
    assert all(torch.equal(x.q, y.q) and torch.equal(x.scale, y.scale) for x, y in zip(pa, pb))


@needs_onednn
def test_decode_with_onednn_projections_equals_the_column_major_path(checkpoint):
    """The same greedy tokens and logits within 1e-5 of the largest, step by step, as the F.linear fast path."""
    from kvwall.engine.caches import make_cache

    path, _ = checkpoint("qwen3")
    model = load_model(path)
    x = ids(2, 12)

    def run():
        c = make_cache("paged", model.spec, 2, 12, block_size=4)
        with torch.inference_mode():
            out = [model(x[:, :5], None, c)]
            out += [model(x[:, t:t + 1], torch.full((2, 1), t), c) for t in range(5, 12)]
        return torch.cat(out, 1)  # (2, 12, V)

    fast = run()
    slow = (model.prepack(False), run())[1]
    assert (fast - slow).abs().max().item() <= 1e-5 * max(1.0, slow.abs().max().item())
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))


def test_without_onednn_a_loaded_model_keeps_column_major_projections(checkpoint, monkeypatch):
    """The fallback: where oneDNN does not run the dtype, prepack leaves F.linear over column-major weights."""
    from kvwall.engine import model as model_module

    monkeypatch.setattr(model_module, "onednn_available", lambda dtype: False)
    path, _ = checkpoint("llama")
    lins = projections(load_model(path))
    assert all(type(lin) is nn.Linear and lin.weight.stride() == (1, lin.weight.shape[0]) for lin in lins)


@needs_onednn
def test_a_tied_head_gets_a_counted_onednn_copy_that_follows_the_table(checkpoint):
    """Gemma 3's head is its token table: the fast path multiplies by a oneDNN copy (V x D x 4 more bytes, held
    besides the table), the state dict holds the table once, and a loaded state dict refreshes the copy."""
    path, _ = checkpoint("gemma3_text")
    model = load_model(path)
    spec = model.spec
    assert spec.tied_embeddings and isinstance(model.head_copy, OneDnnLinear)
    x = ids(2, 10)
    with torch.inference_mode():
        fast = model(x)
        eager_bytes = weight_bytes(model.set_eager(True))
        eager_state = model.state_dict()
        eager = model(x)
    assert model.head_copy is None
    model.set_eager(False)
    assert weight_bytes(model) == eager_bytes + spec.vocab * spec.hidden * 4
    assert set(model.state_dict()) == set(eager_state)  # no key for the copy
    assert (fast - eager).abs().max().item() <= 1e-5 * max(1.0, eager.abs().max().item())
    eager_state["embed.weight"] = eager_state["embed.weight"].flip(0)  # another table: the copy must follow
    model.load_state_dict(eager_state)
    assert torch.equal(model.head_copy.dense_weight(), eager_state["embed.weight"])
    with torch.inference_mode():
        got = model(x)
        want = model.set_eager(True)(x)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
