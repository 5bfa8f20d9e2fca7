"""Weights kept quantized (engine/layers/packed.py): codes against hand-made values, each format within its error
bound, GGUF blocks repacked bit for bit (against the gguf package's own dequantizer), packed models against the
same model holding the dequantized weights in fp32, the C++ kernel against the reference path, the engine's weight
bytes against the predictor's, and --weights' one-line errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from native_kernels import built  # noqa: E402
from tiny_checkpoints import ids  # noqa: E402

from kvwall.cli import main  # noqa: E402
from kvwall.engine import load as load_module  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.layers import packed  # noqa: E402
from kvwall.engine.layers.packed import PackedLinear, dequantize, packed_kernel, quantize, weight_bytes  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.predict.memory import total_weight_bytes  # noqa: E402
from kvwall.spec.formats import engine_weights, get_format  # noqa: E402

FORMATS = ["int8", "int8:sym", "int8:g64", "int8:g16", "int4", "int4:sym", "int4:g128", "int4:g128:sym", "q4_0", "q4_1",
           "q8_0"]


def random_linear(n: int, k: int, seed: int = 0, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    lin.weight.data = torch.randn(n, k) * 0.05
    return lin


# -- codes ---------------------------------------------------------------------------------------------------

def test_int4_codes_and_nibble_order_by_hand():
    """One group of 16 weights 0.0, 0.1, .., 1.5: min 0, scale fp16(0.1) = 0.0999755859375, codes 0..15; byte j
    holds code j (low nibble) and code j + 8 (high nibble)."""
    w = (torch.arange(16, dtype=torch.float32) * 0.1)[None]  # (1, 16)
    q, d, m = quantize(w, get_format("int4:g16"))
    assert d.item() == 0.0999755859375 and m.item() == 0.0
    assert q[0].tolist() == [j | ((j + 8) << 4) for j in range(8)]
    assert torch.equal(dequantize(q, d, m, 4, 16, 16), torch.arange(16.0)[None] * 0.0999755859375)


def test_int8_symmetric_codes_by_hand():
    """int8:sym: d = max|w| / 127, stored codes round(w / d) + 128."""
    w = torch.tensor([[-1.27, 0.0, 0.635, 1.27]])
    q, d, z = quantize(w, get_format("int8:g4:sym"))
    assert z is None and d.item() == 0.01000213623046875  # fp16's nearest to 1.27 / 127 = 0.01 (1311 x 2^-17)
    assert q[0].tolist() == [1, 128, 128 + 63, 255]  # -1.27 / d = -126.97 -> -127; 0.635 / d = 63.49 -> 63


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_within_its_error_bound(name):
    """Per weight: symmetric |w - w'| <= d/2; asymmetric <= d/2 + 2^-11 max|w| (the zero is rounded to fp16).
    K = 200 leaves a short last group for g64 / g128 and q-formats' g32 (200 = 6 x 32 + 8)."""
    fmt = get_format(name)
    lin = random_linear(24, 200)
    p = PackedLinear.from_linear(lin, fmt)
    w, got = lin.weight.data, p.dequantized()  # (N, K)
    G = fmt.group
    d = p.scale.float().repeat_interleave(G, 1)[:, :200]  # (N, K)
    bound = d / 2 * (1 + 1e-5)
    if fmt.zero_bytes:
        big = torch.nn.functional.pad(w.abs(), (0, -200 % G)).view(24, -1, G).amax(-1)  # (N, groups)
        bound = bound + 2 ** -11 * big.repeat_interleave(G, 1)[:, :200]
    assert ((w - got).abs() <= bound).all()
    assert p.weight_bytes() == fmt.bytes(24, 200)  # the predictor's bytes of a (24, 200) matrix


# -- the kernel against the reference ------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows,k", [(1, 200), (1, 256), (1, 640), (1, 2048), (5, 200), (17, 256)])
def test_kernel_equals_reference(name, rows, k):
    """Batch 1 with whole-vector groups (K = 256, 640, 2048: fewer groups a row than a vector holds, more, and a
    whole number of vectors of them) takes the fused path, the rest the row-buffer path."""
    built(packed_kernel, "packed_linear")
    p = PackedLinear.from_linear(random_linear(37, k, bias=True), get_format(name))  # N not a multiple of 4
    x = torch.randn(rows, 1 if rows == 1 else 3, k)
    fast = p(x)
    p.eager = True
    ref = p(x)
    assert fast.shape == ref.shape == (*x.shape[:-1], 37)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("k", [256, 640, 2048])
def test_batch_kernel_equals_reference(name, m, k):
    """A few rows of x (a batched decode step, under the GEMM path's rows): the batch tiles take four rows of x at a
    time and the rest (m = 2, 3, 5, 11 leave 2, 3, 1, 3), two packed rows at a time and 37's last one alone."""
    built(packed_kernel, "packed_linear")
    p = PackedLinear.from_linear(random_linear(37, k, seed=m), get_format(name))
    x = torch.randn(m, k)
    fast = p(x)
    p.eager = True
    torch.testing.assert_close(fast, p(x), rtol=1e-5, atol=1e-5)
    for i in range(m):  # each row of the batch as it would come alone (the batch-1 path)
        p.eager = False
        torch.testing.assert_close(fast[i], p(x[i:i + 1])[0], rtol=1e-5, atol=1e-5)


def test_kernel_takes_bf16_activations():
    built(packed_kernel, "packed_linear")
    p = PackedLinear.from_linear(random_linear(16, 64), get_format("int4"))
    x = torch.randn(2, 64).bfloat16()
    y = p(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), p.reference(x.float()), rtol=2e-2, atol=2e-2)


# -- models --------------------------------------------------------------------------------------------------

def dequantized_copy(path, packed_model, dtype=torch.float32):
    """The same checkpoint in plain float, every projection replaced by the packed model's dequantized matrix: the
    model packed weights stand for."""
    ref = load_model(path, dtype).set_eager(True)  # plain nn.Linear projections, whose weights can be written
    mods = dict(ref.named_modules())
    for name, m in packed_model.named_modules():
        if isinstance(m, PackedLinear):  # a packed table's tied head ("embed.head") stands for the table
            mods[name.removesuffix(".head")].weight.data = m.dequantized().to(dtype)
    return ref.set_eager(False)


@pytest.mark.parametrize("name", ["int8", "int4", "int4:g128:sym", "q4_0"])
def test_packed_model_logits_equal_the_dequantized_model(checkpoint, name):
    path, _ = checkpoint("llama")
    model = load_model(path, weights=name)
    n = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert n == 2 * 2 * 3  # wqkv, wo, w13, w2 per layer; 3 layers
    ref = dequantized_copy(path, model)
    tokens = ids(2, 24)
    with torch.no_grad():
        want = ref(tokens)
        torch.testing.assert_close(model(tokens), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.set_eager(True)(tokens), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])  # untied head; tied + softcap; + positions
@pytest.mark.parametrize("name", ["int4/q8_0", "int8:g64/int4:g32:sym"])
def test_packed_table_and_head_equal_the_dequantized_model(checkpoint, family, name):
    """WEIGHTS/HEAD: the token table (and an untied head) packed too; logits equal the model holding every
    dequantized matrix in fp32, full forward and token-by-token decode; learned positions stay float."""
    path, _ = checkpoint(family)
    model = load_model(path, weights=name)
    assert isinstance(model.embed, packed.PackedEmbedding)
    assert model.lm_head is None or isinstance(model.lm_head, PackedLinear)
    ref = dequantized_copy(path, model)
    tokens = ids(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-4, atol=1e-4)
    prompts = ids(2, 8, seed=5).tolist()
    assert generate(model, prompts, 12).tokens == generate(ref, prompts, 12).tokens


@pytest.mark.parametrize("name", ["int4/q8_0", "q4_1/int8:g32", "int8:g64/int4:g64:sym"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # untied; tied (families whose biases, q/k norms or
# routers the predictor counts in the weight format differ by those few bytes: see the closing note of stop 25)
def test_packed_table_bytes_equal_the_predictor(checkpoint, family, name):
    """Loaded in bf16, a model with its table (and untied head) packed holds the predictor's bytes for the same
    WEIGHTS/HEAD string; its table is stored once when tied."""
    path, _ = checkpoint(family)
    model = load_model(path, "bfloat16", weights=name)
    assert weight_bytes(model) == total_weight_bytes(model.spec, get_format(name, head_ok=True))


def test_int8_greedy_tokens_equal_the_dequantized_run(checkpoint):
    path, _ = checkpoint("llama")
    model = load_model(path, weights="int8")
    ref = dequantized_copy(path, model)
    prompts = ids(2, 12, seed=3).tolist()
    assert generate(model, prompts, 24).tokens == generate(ref, prompts, 24).tokens


def test_without_a_compiler_the_model_runs_the_reference(checkpoint, monkeypatch):
    """packed_kernel() None (no compiler): every PackedLinear dequantizes + F.linear; same logits."""
    path, _ = checkpoint("llama")
    model = load_model(path, weights="int4")
    tokens = ids(1, 10)
    with torch.no_grad():
        fast = model(tokens)
        monkeypatch.setattr(packed, "packed_kernel", lambda: None)
        torch.testing.assert_close(model(tokens), fast, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["int4", "int4:sym", "q4_1", "q8_0", "int8:g32", "int8:g64:sym"])
def test_engine_weight_bytes_equal_the_predictor(checkpoint, name):
    """Loaded in bf16 (embeddings, norms and the LM head 16-bit, as the predictor keeps them), the bytes the
    engine holds equal `kvwall memory --weight-format NAME`'s weights. Groups that divide every row (64, 128)."""
    path, _ = checkpoint("llama")
    model = load_model(path, "bfloat16", weights=name)
    assert weight_bytes(model) == total_weight_bytes(model.spec, get_format(name))
    plain = load_model(path, "bfloat16")
    assert weight_bytes(plain) == total_weight_bytes(plain.spec, get_format("bf16"))


# -- GGUF blocks ---------------------------------------------------------------------------------------------

HELD_AS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q5_0": "q8_0"}  # Q5_0's 5-bit codes fit a Q8_0 byte


@pytest.mark.parametrize("qtype", sorted(HELD_AS))
def test_gguf_blocks_repack_bit_for_bit(tmp_path, qtype):
    """Every projection of a tiny .gguf, repacked, dequantizes to exactly what the gguf package's dequantizer
    gives (GGUFCheckpoint.get, Q/K rows put back); the model logits equal the dequantized load's."""
    gg = pytest.importorskip("gguf")
    from test_gguf import tiny_hf, write_gguf

    from kvwall.engine.gguf import GGUFCheckpoint

    path = tmp_path / f"t-{qtype}.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", getattr(gg.GGMLQuantizationType, qtype))
    ckpt = GGUFCheckpoint(path)
    checked = 0
    for name in ckpt.weight_map:
        got = ckpt.packed(name)
        if got is None or "layers" not in name:
            continue
        q, d, m, fmt = got
        assert fmt.name == HELD_AS[qtype]
        K = ckpt.shapes[name][1]
        mine = dequantize(q, d, m, fmt.bits, K, fmt.group)
        torch.testing.assert_close(mine, ckpt.get(name), rtol=0, atol=1e-6)
        checked += 1
    assert checked == 2 * 7  # q, k, v, o, gate, up, down in 2 layers
    from kvwall.spec.gguf_meta import read_meta, weight_format

    assert weight_format(read_meta(path)) == f"{qtype.lower()}/{qtype.lower()}"  # layers and table alike
    native, plain = load_model(path, weights="native"), load_model(path)
    assert sum(isinstance(m, PackedLinear) for m in native.modules()) == 2 * 4 + 2  # + the table, the untied head
    assert isinstance(native.embed, packed.PackedEmbedding) and isinstance(native.lm_head, PackedLinear)
    tokens = ids(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(native(tokens), plain(tokens), rtol=1e-4, atol=1e-4)


def random_blocks(kind: str, N: int, K: int, elems: int, nbytes: int, d_at: int, d_range, seed: int):
    """N rows of K weights as random blocks of a GGUF type (`elems` weights in `nbytes` bytes, its fp16 d at byte
    d_at drawn from d_range, so every block is finite), as the gguf reader gives a tensor -> (repack's (q, s, m, fmt),
    the gguf package's own dequantization (N, K), the d drawn)."""
    gg = pytest.importorskip("gguf")
    from types import SimpleNamespace

    import numpy as np
    from gguf.quants import dequantize as reference

    from kvwall.engine.gguf import repack

    rng, qt = np.random.default_rng(seed), getattr(gg.GGMLQuantizationType, kind)
    raw = rng.integers(0, 256, (N, K // elems, nbytes), dtype=np.uint8)  # (rows, blocks, block bytes)
    d = rng.uniform(*d_range, (N, K // elems)).astype(np.float16)
    raw[..., d_at:d_at + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(N, K // elems, 2)
    tensor = SimpleNamespace(tensor_type=qt, shape=np.array([K, N]), data=raw.reshape(N, -1))
    want = torch.from_numpy(reference(raw.reshape(N, -1), qt).reshape(N, K).copy())
    return repack(tensor), want, d


def test_q5_0_blocks_repack_as_q8_0_bit_for_bit():
    """Random Q5_0 blocks (any bytes are a block once d is finite), the fifth bits included, repacked as Q8_0
    dequantize to exactly what the gguf package's own dequantizer gives."""
    N, K = 6, 256
    (q, s, m, fmt), want, d = random_blocks("Q5_0", N, K, 32, 22, 0, (1e-3, 2e-2), 1)
    assert fmt.name == "q8_0" and m is None and q.shape == (N, K) and s.shape == (N, K // 32)
    assert torch.equal(dequantize(q, s, m, 8, K, 32), want)
    assert want.abs().max() > 15 * float(d.min())  # codes past 15: the fifth bits are in


def test_q6_k_repacks_as_int8_g16_within_fp16_rounding():
    """Random Q6_K blocks repacked as symmetric int8 groups of 16 dequantize to what the gguf package's own
    dequantizer gives, within the fp16 rounding of each group's d sc: 2^-11 of 32 |d'| per weight (|q - 32| <= 32)."""
    N, K = 6, 512
    (q, s, m, fmt), want, _ = random_blocks("Q6_K", N, K, 256, 210, 208, (1e-4, 2e-3), 2)
    assert (fmt.name, fmt.bits, fmt.group, fmt.zero_bytes) == ("int8", 8, 16, 0) and m is None
    assert q.shape == (N, K) and s.shape == (N, K // 16)
    mine = dequantize(q, s, m, 8, K, 16)  # (N, K)
    bound = 32 * s.float().abs().repeat_interleave(16, 1) * 2.0 ** -11
    assert ((mine - want).abs() <= bound + 1e-9).all()
    assert (mine - want).abs().max() > 0 and (want < 0).any() and (want > 0).any()  # rounded; both signs


def test_k_quant_scales_outside_fp16_stay_dequantized():
    """A Q6_K tensor whose d sc falls below fp16's normal range (2^-14) would lose more than 2^-11 of a scale as a
    subnormal: repack declines it (None: the checkpoint dequantizes it instead), as it does past 65504."""
    got, _, _ = random_blocks("Q6_K", 2, 256, 256, 210, 208, (1e-7, 2e-7), 3)
    assert got is None
    got, _, _ = random_blocks("Q6_K", 2, 256, 256, 210, 208, (1e3, 2e3), 3)
    assert got is None


def test_q4_k_repacks_as_q4_1_within_fp16_rounding():
    """Random Q4_K blocks (any bytes are a block once d and dmin are finite) repacked as Q4_1 dequantize to what the
    gguf package's own dequantizer gives, within the fp16 rounding of each sub-block's d sc and dmin m: 2^-11 of
    15 |d'| + |m'| per weight."""
    gg = pytest.importorskip("gguf")
    from types import SimpleNamespace

    import numpy as np
    from gguf.quants import dequantize as reference

    from kvwall.engine.gguf import repack

    N, K, rng = 6, 512, np.random.default_rng(0)
    raw = rng.integers(0, 256, (N, K // 256, 144), dtype=np.uint8)  # (rows, blocks, block bytes)
    d_dmin = rng.uniform(1e-3, 2e-2, (N, K // 256, 2)).astype(np.float16)
    raw[..., 0:4] = np.frombuffer(d_dmin.tobytes(), np.uint8).reshape(N, K // 256, 4)
    tensor = SimpleNamespace(tensor_type=gg.GGMLQuantizationType.Q4_K, shape=np.array([K, N]), data=raw.reshape(N, -1))
    q, d, m, fmt = repack(tensor)
    assert fmt.name == "q4_1" and q.shape == (N, K // 2) and d.shape == m.shape == (N, K // 32)
    mine = dequantize(q, d, m, 4, K, 32)  # (N, K)
    want = torch.from_numpy(reference(raw.reshape(N, -1), gg.GGMLQuantizationType.Q4_K).reshape(N, K).copy())
    bound = (15 * d.float().abs() + m.float().abs()).repeat_interleave(32, 1) * 2.0 ** -11
    assert ((mine - want).abs() <= bound + 1e-9).all()
    assert (m < 0).any() and want.abs().max() > 0.1  # mins subtracted, weights of a real scale


@pytest.mark.slow
@pytest.mark.real
def test_gemma3_q4_k_m_matrices_are_all_held_packed():
    """The real Gemma 3 270M file (Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K tensors): every engine matrix is held packed,
    in the layout its file type repacks into (Q5_0 and Q8_0 as Q8_0, Q4_K as Q4_1, Q6_K as int8 groups of 16), the
    Q8_0 token table too, and the logits stay those of the dequantized load up to the K-quant scales' fp16
    rounding."""
    from kvwall.spec.gguf_meta import packaged_path

    try:
        path = packaged_path("gemma-3-270m")
    except KvwallError as exc:
        pytest.skip(str(exc))
    native, plain = load_model(path, weights="native"), load_model(path)
    gg = pytest.importorskip("gguf")
    kinds = {t.name: t.tensor_type.name for t in gg.GGUFReader(path).tensors}
    held_as = {"Q5_0": "q8_0", "Q8_0": "q8_0", "Q4_K": "q4_1", "Q6_K": "int8:g16:sym"}
    parts = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "w13": ("ffn_gate", "ffn_up"),
             "w2": ("ffn_down",)}
    want = {}
    for i in range(18):
        for mine, theirs in parts.items():
            (label,) = {held_as[kinds[f"blk.{i}.{p}.weight"]] for p in theirs}  # one layout per engine matrix
            want[f"{i}.{mine}"] = label
    held = {n.replace("layers.", "").replace("mixer.", "").replace("ffn.", ""): m.fmt.label
            for n, m in native.named_modules() if isinstance(m, PackedLinear) and n.startswith("layers.")}
    assert held == want and {"q8_0", "q4_1", "int8:g16:sym"} == set(want.values())
    assert native.embed.head.fmt.label == "q8_0"
    assert not any(type(m).__name__ == "OneDnnLinear" for m in native.modules())  # nothing left dequantized
    tokens = ids(1, 12)
    with torch.no_grad():
        a, b = native(tokens), plain(tokens)
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    assert torch.equal(a[0, -1].topk(5).indices, b[0, -1].topk(5).indices)


@pytest.mark.slow
def test_smollm2_q4_1_native_bytes_equal_the_predictor():
    """The real model's file: every projection is Q4_1, so held natively in bf16 it is `--weight-format q4_1`."""
    from kvwall.spec.gguf_meta import packaged_path

    try:
        path = packaged_path("smollm2-135m")
    except KvwallError as exc:
        pytest.skip(str(exc))
    model = load_model(path, "bfloat16", weights="native")
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 30 * 4 + 1  # and the Q8_0 table's head
    assert weight_bytes(model) == total_weight_bytes(model.spec, get_format("q4_1/q8_0", head_ok=True))


@pytest.mark.slow
def test_smollm2_file_bytes_equal_the_predictor():
    """Independent of the engine: the bytes the gguf package gives for each tensor of SmolLM2's file add up to
    `--weight-format q4_1/q8_0`, the norms (F32 in the file) counted at the predictor's 2 bytes."""
    gg = pytest.importorskip("gguf")
    from kvwall.spec.gguf_meta import config_from_meta, packaged_path, read_meta, weight_format
    from kvwall.spec.hf import spec_from_config

    try:
        path = packaged_path("smollm2-135m")
    except KvwallError as exc:
        pytest.skip(str(exc))
    reader = gg.GGUFReader(str(path))
    f32 = gg.GGMLQuantizationType.F32
    quant = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type != f32)
    norms = sum(int(t.n_elements) for t in reader.tensors if t.tensor_type == f32)
    spec = spec_from_config(config_from_meta(read_meta(path)), name="smollm2")
    assert quant + 2 * norms == total_weight_bytes(spec, get_format("q4_1/q8_0", head_ok=True))
    assert weight_format(read_meta(path)) == "q4_1/q8_0"  # what `kvwall show` names it


# -- bad values ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["int3", "int2", "fp8", "nvfp4", "int4:g7", "q4_k", "banana"])
def test_unknown_weights_value_is_one_line(checkpoint, capsys, bad):
    path, _ = checkpoint("llama")
    rc = main(["generate", str(path), "--prompt-ids", "1,2", "--weights", bad])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--weights" in err and "int4" in err
    with pytest.raises(KvwallError):
        engine_weights(bad)


def test_native_on_safetensors_is_one_line(checkpoint, capsys):
    path, _ = checkpoint("llama")
    rc = main(["generate", str(path), "--prompt-ids", "1,2", "--weights", "native"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and ".gguf" in err, err


def test_float_weights_set_the_dtype(checkpoint):
    path, _ = checkpoint("llama")
    assert load_module.load_model(path, weights="bf16").embed.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["q8_0", "int8:g16", "q4_1", "int4:g128:sym"])
def test_packed_embedding_rows_are_the_tables_dequantized_rows(name):
    """The looked-up rows, through the compiled dequantize and through torch's (eager), are bit for bit the rows of
    the dequantized table; token ids in any shape, repeated ids too."""
    built(packed_kernel, "packed_linear")
    head = PackedLinear.from_linear(random_linear(50, 256), get_format(name))
    emb = packed.PackedEmbedding(head, torch.float32)
    tokens = torch.tensor([[3, 49, 3], [0, 17, 8]])  # (2, 3)
    want = head.dequantized()[tokens]  # (2, 3, 256)
    assert torch.equal(emb(tokens), want)
    head.eager = True
    assert torch.equal(emb(tokens), want)
