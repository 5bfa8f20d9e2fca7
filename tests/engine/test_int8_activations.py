"""Int8 activations (--weights ...+a8, Transformer.set_activations): each packed projection's input rounded to int8
per weight group, then multiplied exactly. The rounding against hand-computed codes; the kernel (the integer
VNNI path over the codes' tiles where the CPU has it, the float paths on the rounded x elsewhere) against this
file's own rounding in numpy times the dequantized matrix; a model against the same model in plain float with its
projections' inputs rounded by forward hooks, full forward and decode; the tiles' layout; and --weights' parsing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from native_kernels import built  # noqa: E402

from kvwall.cli import main  # noqa: E402
from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.layers.packed import PackedLinear, pack_model, packed_kernel, round_x8, x8_tiles  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.engine.model import Transformer  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.spec.formats import engine_weights, get_format, split_activations  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("two_threads")  # conftest.py: 2 threads, as CI has


def rounded(x: torch.Tensor, G: int) -> torch.Tensor:
    """This test's own rounding, in numpy float32: per group m = max|x|, codes rint(x * (127 / m)), values
    codes * (m / 127); a shorter last group on its own."""
    a = x.detach().float().numpy().astype(np.float32)
    out = np.zeros_like(a)
    for k0 in range(0, a.shape[-1], G):
        g = a[..., k0:k0 + G]
        m = np.abs(g).max(axis=-1, keepdims=True)
        inv = np.where(m > 0, np.float32(127) / np.where(m > 0, m, np.float32(1)), np.float32(0)).astype(np.float32)
        out[..., k0:k0 + G] = np.rint(g * inv) * (m / np.float32(127))
    return torch.from_numpy(out)


def test_rounding_by_hand():
    """Group of 4 with max 1: 0.5 * 127 = 63.5 rounds to the even 64, 0.25 * 127 = 31.75 to 32; an all-zero group
    stays 0; a group with max 2: 1 * 63.5 -> 64, -0.5 * 63.5 = -31.75 -> -32, 0.3 * 63.5 = 19.05 -> 19."""
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0, -0.5, 0.3]])
    want = torch.tensor([[64 / 127, -1.0, 32 / 127, 0.0, 0, 0, 0, 0, 2.0, 64 * 2 / 127, -32 * 2 / 127, 19 * 2 / 127]])
    torch.testing.assert_close(round_x8(x, 4), want, rtol=1e-7, atol=0)
    torch.testing.assert_close(rounded(x, 4), want, rtol=1e-7, atol=0)


@pytest.mark.parametrize("k", [64, 640])
def test_kernel_rounds_by_hand(k):
    """One row through a q8_0-like diagonal matrix: every group's one weight 127 * 2^-7 (scale 2^-7, exact in fp16),
    so y_i = (127/128) x'_i with x' the hand-checked rounding, on whichever path this CPU takes at one row."""
    built(packed_kernel, "packed_linear")
    lin = torch.nn.Linear(k, k, bias=False)
    lin.weight.data = torch.eye(k) * (127 / 128)
    p = PackedLinear.from_linear(lin, get_format("int8:g32:sym"))
    torch.testing.assert_close(p.dequantized(), torch.eye(k) * (127 / 128), rtol=0, atol=0)
    p.x8 = True
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)) * 3
    torch.testing.assert_close(p(x), rounded(x, 32) * (127 / 128), rtol=1e-6, atol=1e-7)


FORMATS = ["q8_0", "int8:g16:sym", "int8:g32", "int8:g128:sym", "int4:g32", "q4_0"]


@pytest.mark.parametrize("name", FORMATS)
# m = 1, 2, 3, 5, 40: the integer kernel where the CPU has VNNI, passes of 1, 2, 3 and 4 rows over each tile (40: ten
# of 4), else the float kernels (1: one row; 2, 3, 5: the batch tiles; 40: the GEMM path) on the rounded x
@pytest.mark.parametrize("m", [1, 2, 3, 5, 40])
# 200: a short last group, the float path on the rounded x; 576 (SmolLM2's width); 640, 2048: Gemma 3's widths.
# 37 outputs: two whole tiles of 16 and a last one of 5
@pytest.mark.parametrize("k", [200, 576, 640, 2048])
def test_kernel_equals_rounded_x_times_the_matrix(name, m, k):
    """Against the rounded x times the dequantized matrix in float64, within float32's accumulation error: 2e-6 of
    Σ |x_k w_k| (8 ulps; a lost or misplaced group's scale is off by its whole share). The worst seen on the two
    AVX-512 hosts was 4.3e-7 of it; a float32 reference itself misses by 1e-5 where an outlier block cancels."""
    built(packed_kernel, "packed_linear")
    torch.manual_seed(m * k)
    lin = torch.nn.Linear(k, 37, bias=True)
    lin.weight.data = torch.randn(37, k) * 0.05
    p = PackedLinear.from_linear(lin, get_format(name))
    p.x8 = True
    x = torch.randn(m, k) * 2
    x[0, :7] *= 40  # an outlier block: its group's scale is large, the others' are not
    xr, w, b = rounded(x, p.group).double(), p.dequantized().double(), lin.bias.data.double()
    want = torch.nn.functional.linear(xr, w, b)  # (m, 37)
    bound = 2e-6 * (xr.abs() @ w.abs().T + b.abs()) + 1e-7  # (m, 37)
    err = (p(x).double() - want).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"
    exact = torch.nn.functional.linear(x, p.dequantized(), lin.bias.data)
    assert not torch.allclose(p(x), exact, rtol=1e-5, atol=1e-5)  # the rounding is real: not the exact product


def tiny(seed: int = 0) -> Transformer:
    """A llama whose matrices are all 64 or 128 wide (whole 64-byte steps for the integer kernel), 3 layers."""
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 50, "max_position_embeddings": 96,
           "rms_norm_eps": 1e-6}
    torch.manual_seed(seed)
    model = Transformer(spec_from_config(cfg, name="tiny"))
    for prm in model.parameters():
        prm.data.normal_(0, 0.3)
    return model.set_eager(False)


def hooked_float_copy(packed_model: Transformer) -> Transformer:
    """The same model in plain float (eager), each packed matrix dequantized, each of those projections' inputs
    rounded by this file's `rounded` in a forward pre-hook."""
    ref = tiny().set_eager(True)
    mods = dict(ref.named_modules())
    for name, mod in packed_model.named_modules():
        if isinstance(mod, PackedLinear):
            lin = mods[name]
            lin.weight.data = mod.dequantized()
            lin.register_forward_pre_hook(lambda _, args, g=mod.group: (rounded(args[0], g),))
    return ref


@pytest.mark.parametrize("name", ["q8_0", "int8:g16", "int4:g32"])
def test_model_equals_float_model_with_rounded_inputs(name):
    """Full forward (the GEMM path: 2 x 40 rows) against the hooked float model within 1e-4; back to exact, against
    the plain float model."""
    model = pack_model(tiny(), get_format(name)).set_activations("int8")
    assert all(m.x8 for m in model.modules() if isinstance(m, PackedLinear))
    ref = hooked_float_copy(model)
    tokens = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-4, atol=1e-4)
        model.set_activations("fp32")  # back to exact: the plain float model's logits, not the rounded ones
        plain = hooked_float_copy(model)
        for mod in plain.modules():
            mod._forward_pre_hooks.clear()
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["q8_0", "int8:g16", "int4:g32"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_equals_the_full_forward(name, batch):
    """Prefill P tokens (P = 1, 5, 8, 16 rows of x a sequence), then one token a step (batch rows of x a step: the
    fused decode step), against the hooked float model's full forward; the integer kernel on every path where the CPU
    has VNNI, else the float kernels on the rounded x.

    A code at a rounding tie can flip between two paths whose inputs differ by float rounding (1e-7); one input then
    moves by one step, max|x|/127, and every later logit by up to ~1e-2 (measured on this model: 8e-3 and 1.4e-2, in
    2 of 6 runs). So every run keeps the greedy picks and stays within 3e-2, and at least one run of the four
    matches within 1e-5 throughout: wrong scales, codes or offsets would move every logit of every run (by ~1e-1 or
    more)."""
    model = pack_model(tiny(), get_format(name)).set_activations("int8")
    tokens = torch.randint(0, 50, (batch, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hooked_float_copy(model)(tokens)  # (batch, 40, V)
        exact_runs = 0
        for prefill in (1, 5, 8, 16):
            cache = make_cache("contiguous", model.spec, batch, 41)
            steps = [model(tokens[:, :prefill], None, cache)[:, -1]]
            for t in range(prefill, 40):
                steps.append(model(tokens[:, t:t + 1], torch.full((batch, 1), t), cache)[:, -1])
            got, ref = torch.stack(steps, 1)[:, :-1], want[:, prefill - 1:39]  # positions prefill-1 .. 38
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
            torch.testing.assert_close(got, ref, rtol=0, atol=3e-2)
            exact_runs += bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-5))
        assert exact_runs >= 1


def test_tiles_by_hand():
    """x8_tiles: 20 rows of 8 code bytes -> 2 tiles of (8/4 steps, 16 rows, 4 bytes); rows 20..31 are zeros. Row 19's
    bytes 4..7 are tile 1, step 1, lane 3; its group 1's scale is tile 1, group 1, lane 3."""
    q = torch.arange(160, dtype=torch.uint8).view(20, 8)
    scale = torch.arange(40, dtype=torch.float16).view(20, 2)
    qt, st, zt = x8_tiles(q, scale, None)
    assert qt.shape == (2, 2, 16, 4) and st.shape == (2, 2, 16) and zt is None
    assert qt[1, 1, 3].tolist() == [156, 157, 158, 159] and qt[0, 0, 0].tolist() == [0, 1, 2, 3]
    assert qt[0, 1, 5].tolist() == [44, 45, 46, 47] and not qt[1, :, 4:].any()
    assert st[1, 1, 3].item() == 39 and st[0, 0, 5].item() == 10 and not st[1, :, 4:].any()
    _, _, zt = x8_tiles(q, scale, scale + 1)
    assert zt[1, 1, 3].item() == 40


def test_no_rows():
    """Zero rows of x (a MoE expert no token chose) give zero rows of y, on the integer path and off it."""
    built(packed_kernel, "packed_linear")
    p = PackedLinear.from_linear(torch.nn.Linear(64, 20, bias=False), get_format("q8_0"))
    p.x8 = True
    assert p(torch.zeros(0, 64)).shape == (0, 20)


def test_tiles_follow_the_mode():
    """x8 on builds the tiles where the integer kernel runs (X8_INTEGER and a fitting shape); off drops them."""
    built(packed_kernel, "packed_linear")
    from kvwall.engine import native

    integer = bool(native.build("packed_linear", "dequantize + F.linear (torch)")[0].X8_INTEGER)
    lin = torch.nn.Linear(64, 20, bias=False)
    p = PackedLinear.from_linear(lin, get_format("q8_0"))
    assert p.x8_tiles is None
    p.x8 = True
    assert (p.x8_tiles is not None) == integer
    p.x8 = False
    assert p.x8_tiles is None
    odd = PackedLinear.from_linear(torch.nn.Linear(200, 20, bias=False), get_format("q8_0"))  # 200 = 6 groups + 8
    odd.x8 = True
    assert odd.x8_tiles is None


def test_weights_spelling():
    assert split_activations("native+a8") == ("native", "int8")
    assert split_activations("q8_0") == ("q8_0", "fp32")
    assert engine_weights("native+a8") is None
    assert engine_weights("int4/q8_0+a8").label == engine_weights("int4/q8_0").label
    with pytest.raises(KvwallError, match="packs none"):
        engine_weights("bf16+a8")


def test_load_sets_the_mode(checkpoint):
    path, _ = checkpoint("llama")
    model = load_model(path, weights="int8+a8")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.x8 for m in packed)
    assert not any(m.x8 for m in load_model(path, weights="int8").modules() if isinstance(m, PackedLinear))


def test_float_weights_with_a8_is_one_line(checkpoint, capsys):
    path, _ = checkpoint("llama")
    capsys.readouterr()  # the checkpoint's own writing, when this test made it
    rc = main(["generate", str(path), "--prompt-ids", "1,2", "--weights", "fp32+a8"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "packs none" in err and "native+a8" in err


def test_the_integer_kernel_is_built_where_the_cpu_has_vnni():
    """The build's flags follow the CPU: -mavx512vnni where torch runs AVX-512 and /proc/cpuinfo lists avx512_vnni,
    so one-row int8 activations take vpdpbusd there (X8_INTEGER), and the float paths elsewhere."""
    from kvwall.engine import native

    built(packed_kernel, "packed_linear")
    mod = native.build("packed_linear", "dequantize + F.linear (torch)")[0]
    info = Path("/proc/cpuinfo")
    flags = set(info.read_text().split()) if info.exists() else set()
    want = torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_vnni" in flags
    assert bool(mod.X8_INTEGER) == want
