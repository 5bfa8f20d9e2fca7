"""Mamba, falcon_mamba and Mamba-2 in the engine against transformers; the fast scan against the plain loop;
the fixed state's bytes against the predictor, whatever the length."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from native_kernels import built  # noqa: E402
from tiny_checkpoints import VOCAB, ids, randomize, transformers_greedy  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.layers.mamba import (  # noqa: E402
    causal_conv,
    scan_chunked,
    scan_prefill,
    scan_reference,
    scan_step,
    scan_trainable,
)
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.predict.memory import Formats, memory  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402

NO_TOKENS = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "mamba": lambda: transformers.MambaConfig(**NO_TOKENS, hidden_size=64, state_size=8, num_hidden_layers=3,
                                              tie_word_embeddings=False),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(**NO_TOKENS, hidden_size=64, state_size=8,
                                                           num_hidden_layers=3, mixer_rms_eps=1e-5,
                                                           tie_word_embeddings=False),
    "mamba2": lambda: transformers.Mamba2Config(**NO_TOKENS, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
                                                n_groups=2, num_hidden_layers=3, chunk_size=16,
                                                tie_word_embeddings=True),
}  # tied embeddings make a random Mamba repeat one token (the residual stream copies its input): untied there
FAMILIES = list(CONFIGS)


@pytest.fixture(scope="module")
def ssm(tmp_path_factory):
    """ssm(family) -> (engine model, transformers model), built once per module."""
    made = {}

    def get(family):
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            torch.manual_seed(0)
            ref = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
            randomize(ref, seed=1)
            ref.save_pretrained(path)
            made[family] = (load_model(path), ref)
        return made[family]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_equals_transformers(family, ssm):
    model, ref = ssm(family)
    x = ids(length=45)  # not a multiple of the scan chunks
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_chunk_and_decode_equal_full_forward(family, ssm):
    """Prefill 5 tokens, then a chunk of 7 on top of the state, then one token at a time."""
    model, _ = ssm(family)
    x = ids(length=30)
    B, T = x.shape
    with torch.no_grad():
        full = model(x)
        c = make_cache("contiguous", model.spec, B, T)
        steps = [model(x[:, :5], None, c), model(x[:, 5:12], torch.arange(5, 12).expand(B, 7), c)]
        steps += [model(x[:, t:t + 1], torch.full((B, 1), t), c) for t in range(12, T)]
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_32_tokens_equals_transformers_generate(family, ssm):
    model, ref = ssm(family)
    prompt = ids(batch=1, length=12, seed=1)
    expected = transformers_greedy(ref, prompt)
    got = generate(model, [prompt[0].tolist()], max_new_tokens=32).tokens[0]
    assert len(set(expected)) > 1, "a degenerate reference would prove little"
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_right_padded_batch_equals_one_by_one(family, ssm):
    """Padding gets Δ = 0 and never enters the conv state, so each row's state is its own."""
    model, _ = ssm(family)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 21, 9)]
    batch = generate(model, prompts, max_new_tokens=12).tokens
    alone = [generate(model, [p], max_new_tokens=12).tokens[0] for p in prompts]
    assert batch == alone


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_state_bytes_do_not_grow_and_equal_the_predictor(family, ssm):
    """After 16 tokens and after 1,216 (1,184 more through the fast scan, then 16 decode steps): same bytes."""
    model, _ = ssm(family)
    x = ids(1, 1216)
    cache = make_cache("contiguous", model.spec, 1, 1216)
    with torch.no_grad():
        model(x[:, :16], None, cache)
        after_16 = cache.nbytes()
        model(x[:, 16:1200], torch.arange(16, 1200)[None], cache)
        for t in range(1200, 1216):
            model(x[:, t:t + 1], torch.tensor([[t]]), cache)
    fp32 = Formats(get_format("fp32"), get_format("fp32"), get_format("fp32"))
    predicted = memory(model.spec, batch=1, context=16, formats=fp32).cache_bytes
    assert cache.state.seen == [1216]  # tokens the state has taken in
    assert after_16 == cache.nbytes() == predicted > 0
    assert memory(model.spec, batch=1, context=16_384, formats=fp32).cache_bytes == predicted
    assert generate(model, [[1, 2, 3]], max_new_tokens=4).cache_bytes == predicted


def test_state_bytes_by_hand(ssm):
    """Mamba: per layer d_inner x (d_conv + d_state) elements, 3 layers, batch 2, fp32."""
    model, _ = ssm("mamba")
    cache = make_cache("contiguous", model.spec, 2, 10)
    assert cache.nbytes() == 2 * 3 * 128 * (4 + 8) * 4


def test_a_state_cannot_skip_or_rewind(ssm):
    model, _ = ssm("mamba")
    c = make_cache("contiguous", model.spec, 1, 64)
    with torch.no_grad():
        model(ids(1, 8), None, c)
        with pytest.raises(KvwallError, match="cannot skip or rewind"):
            model(ids(1, 1), torch.tensor([[9]]), c)
        model(ids(1, 1), torch.tensor([[8]]), c)  # where it stopped: fine
        model(ids(1, 4), None, c)  # position 0: a new sequence


def scan_inputs(B=2, T=37, E=24, N=6, big_dt=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, T, E, generator=g)
    dt = torch.rand(B, T, E, generator=g) * (20.0 if big_dt else 0.2)  # big: exp(ΔA) underflows to 0
    A = -torch.rand(E, N, generator=g) * 4 - 0.1
    Bm, Cm = torch.randn(B, T, N, generator=g), torch.randn(B, T, N, generator=g)
    return u, dt, A, Bm, Cm, torch.randn(B, E, N, generator=g)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
@pytest.mark.parametrize("big_dt", [False, True])
def test_fast_scan_equals_reference(chunk, big_dt):
    u, dt, A, Bm, Cm, h0 = scan_inputs(big_dt=big_dt)
    y_ref, h_ref = scan_reference(u, dt, A, Bm, Cm, h0)
    y, h = scan_chunked(u, dt, A, Bm, Cm, h0, chunk=chunk)
    assert torch.isfinite(y).all()
    assert (y - y_ref).abs().max().item() < 1e-4 and (h - h_ref).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("big_dt", [False, True])
def test_trainable_scan_equals_reference_values_and_gradients(dtype, tol, big_dt):
    """The training path (kvwall recall) against the plain loop run through autograd: outputs, final state and
    every input's gradient (h0 included), with a loss on both outputs; scan_prefill takes it exactly when a
    gradient is wanted, and leaves the caller's h untouched."""
    inputs = [x.to(dtype) for x in scan_inputs(T=37, E=32, big_dt=big_dt)]  # fp32, E 32: the C++ pair if it builds
    ref = [x.clone().requires_grad_(True) for x in inputs]
    mine = [x.clone().requires_grad_(True) for x in inputs]
    y_ref, h_ref = scan_reference(*ref)
    y, h = scan_prefill(*mine)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert (y - y_ref).abs().max().item() < tol * (1 + y_ref.abs().max().item())
    assert (h - h_ref).abs().max().item() < tol * (1 + h_ref.abs().max().item())
    w, wh = torch.randn_like(y), torch.randn_like(h)
    ((y_ref * w).sum() + (h_ref * wh).sum()).backward()
    ((y * w).sum() + (h * wh).sum()).backward()
    for a, b in zip(ref, mine):
        assert (a.grad - b.grad).abs().max().item() < tol * (1 + a.grad.abs().max().item())
    h0 = inputs[-1].clone()
    scan_trainable(*inputs[:-1], h0)
    assert torch.equal(h0, inputs[-1])


@pytest.mark.slow
@pytest.mark.parametrize("n_state", [16, 5])
def test_fused_scan_backward_equals_autograd_through_the_loop(n_state):
    """The C++ backward (training on the CPU) gives the gradients autograd finds through scan_reference (float64)."""
    from kvwall.engine.layers.scan_kernel import fused_scan_backward

    backward = fused_scan_backward()
    if backward is None:
        pytest.skip("the selective_scan kernel did not build here")
    inputs = scan_inputs(B=3, T=29, E=32, N=n_state, big_dt=True)
    ref = [x.double().requires_grad_(True) for x in inputs]
    y, h = scan_reference(*ref)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    ((y * gy).sum() + (h * gh).sum()).backward()
    mine = backward(*inputs, gy.float(), gh.float())
    for a, b in zip(ref, mine):
        assert b.shape == a.shape and (a.grad - b).abs().max().item() < 1e-4 * (1 + a.grad.abs().max().item())


def test_decode_step_equals_reference():
    u, dt, A, Bm, Cm, h = scan_inputs(T=5)
    y_ref, h_ref = scan_reference(u, dt, A, Bm, Cm, h)
    ys = []
    for t in range(5):
        y, h = scan_step(u[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], h)
        ys.append(y)
    assert (torch.stack(ys, 1) - y_ref).abs().max().item() < 1e-5 and (h - h_ref).abs().max().item() < 1e-5


def test_causal_conv_keeps_each_rows_last_inputs():
    conv = torch.nn.Conv1d(3, 3, 4, groups=3)
    x = torch.randn(2, 6, 3)  # (B, T, C)
    state = torch.zeros(2, 3, 4)
    y = causal_conv(x, state, conv, torch.tensor([6, 2]))
    expected = conv(torch.nn.functional.pad(x.transpose(1, 2), (3, 0)))  # zero history, causal
    assert torch.allclose(y, expected.transpose(1, 2), atol=1e-6)
    assert y.is_contiguous()  # (B, T, C) dense: the fused scan reads it without a transposing copy
    assert torch.equal(state[0], x[0, 2:6].T) and torch.equal(state[1, :, 2:], x[1, :2].T)
    assert torch.equal(state[1, :, :2], torch.zeros(3, 2))  # row 1 saw 2 tokens: two zeros of history kept


@pytest.mark.slow
@pytest.mark.parametrize("n_state", [16, 5])
def test_fused_scan_equals_reference(n_state):
    """The C++ scan (built on first use) gives the reference recurrence's outputs and final state."""
    from kvwall.engine.layers.scan_kernel import fused_scan

    fused = built(fused_scan, "selective_scan")
    g = torch.Generator().manual_seed(3)
    B, T, E = 2, 37, 32
    u, dt = torch.randn(B, T, E, generator=g), torch.rand(B, T, E, generator=g) * 0.5
    A = -torch.rand(E, n_state, generator=g) * 4
    Bm, Cm, h0 = torch.randn(B, T, n_state, generator=g), torch.randn(B, T, n_state, generator=g), \
        torch.randn(B, E, n_state, generator=g)
    y_ref, h_ref = scan_reference(u, dt, A, Bm, Cm, h0)
    y, h = fused(u, dt, A, Bm, Cm, h0)
    assert torch.allclose(y, y_ref, atol=1e-4, rtol=1e-4) and torch.allclose(h, h_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_fused_scan_reads_strided_views():
    """The model hands the scan slices of larger projections: strided inputs give the same result."""
    from kvwall.engine.layers.scan_kernel import fused_scan

    fused = built(fused_scan, "selective_scan")
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(1, 20, 2 * 32, generator=g)  # (B, T, 2E): u is its first half, as in_proj's chunk
    u, dt = wide[..., :32], torch.rand(1, 20, 32, generator=g)
    xbc = torch.randn(1, 20, 3 * 16, generator=g)  # (B, T, ...): B and C are slices, as x_proj's split
    Bm, Cm = xbc[..., 16:32], xbc[..., 32:]
    A, h0 = -torch.rand(32, 16, generator=g), torch.zeros(1, 32, 16)
    y_ref, h_ref = scan_reference(u, dt, A, Bm, Cm, h0)
    y, h = fused(u, dt, A, Bm, Cm, h0)
    assert not u.is_contiguous() and torch.allclose(y, y_ref, atol=1e-5) and torch.allclose(h, h_ref, atol=1e-5)
