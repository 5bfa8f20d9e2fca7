"""Broken checkpoints through the CLI (`kvwall verify DIR`, `kvwall generate DIR --prompt-ids 1,2`): exit 2,
one line (two at most) on stderr naming the file or tensor, no traceback. Each case breaks a copy of a tiny
llama (single file or sharded) in one way; a few checkpoints that look odd but are fine must still load."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tiny_checkpoints import make_checkpoint  # noqa: E402

from kvwall.cli import main  # noqa: E402

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
L = "model.layers."  # the tiny llama: 3 layers, hidden 64, 4 query heads and 2 K/V heads of 16, d_ff 128


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny llama saved whole and in shards (the same weights)."""
    root = tmp_path_factory.mktemp("bad")
    make_checkpoint("llama", root / "single")
    make_checkpoint("llama", root / "sharded", max_shard_size="60KB")
    assert len(shards(root / "sharded")) >= 3
    return root


def shards(path) -> list[str]:
    return sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))


# -- ways to break a checkpoint ------------------------------------------------

def edit_state(fn, file=SINGLE):
    """Load a safetensors file, change its tensors with fn(state), save it back."""
    def apply(path):
        state = safetensors_torch.load_file(path / file)
        fn(state)
        safetensors_torch.save_file(state, path / file, metadata={"format": "pt"})
    return apply


def edit_config(**changes):
    def apply(path):
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(changes)
        (path / "config.json").write_text(json.dumps(cfg))
    return apply


def write(data: bytes, file=SINGLE):
    def apply(path):
        (path / file).write_bytes(data)
    return apply


def cut(keep, file=SINGLE):
    """Keep the first keep(size) bytes of a file."""
    def apply(path):
        data = (path / file).read_bytes()
        (path / file).write_bytes(data[:keep(len(data))])
    return apply


def with_header(header, file=SINGLE):
    """Replace a file's header (bytes or a JSON-able object), keeping its data."""
    def apply(path):
        data = (path / file).read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        (path / file).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    return apply


def edit_header(fn, file=SINGLE):
    """Change a file's parsed header with fn(header)."""
    def apply(path):
        data = (path / file).read_bytes()
        header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
        fn(header)
        with_header(header, file)(path)
    return apply


def edit_index(fn):
    def apply(path):
        index = json.loads((path / INDEX).read_text())
        fn(index)
        (path / INDEX).write_text(json.dumps(index))
    return apply


def on_shard(i, make):
    """Apply make(shard file name) to the i-th shard of the sharded checkpoint."""
    def apply(path):
        make(shards(path)[i])(path)
    return apply


def move_to_other_shard(name):
    """The index says `name` is in a shard other than the one holding it."""
    def fn(index):
        wm = index["weight_map"]
        wm[name] = next(s for s in sorted(set(wm.values())) if s != wm[name])
    return edit_index(fn)


def resplit(first, second, rows):
    """Move `rows` rows from the end of tensor `first` to the front of `second` (a fused tensor cut at the
    wrong row: the joined size is unchanged)."""
    def fn(state):
        a, b = state[first], state[second]
        state[first], state[second] = a[:-rows].clone(), torch.cat([a[-rows:], b]).clone()
    return edit_state(fn)


def set_value(name, value, where=(0, 0)):
    def fn(state):
        state[name][where] = value
    return edit_state(fn)


def drop(*names):
    def fn(state):
        for n in names:
            del state[n]
    return edit_state(fn)


def add(name, shape, dtype=torch.float32):
    def fn(state):
        state[name] = torch.zeros(shape, dtype=dtype)
    return edit_state(fn)


def replace(name, shape, dtype=torch.float32):
    def fn(state):
        state[name] = torch.ones(shape).to(dtype)
    return edit_state(fn)


def remove_shard(i):
    def apply(path):
        (path / shards(path)[i]).unlink()
    return apply


# -- the cases: (id, base, break, text the message must contain) ----------------

CASES = [
    # safetensors files that are not safetensors
    ("zero-bytes", "single", write(b""), SINGLE),
    ("five-bytes", "single", write(b"\x10\0\0\0\0"), SINGLE),
    ("truncated-in-header", "single", cut(lambda n: 40), SINGLE),
    ("truncated-in-data", "single", cut(lambda n: n // 2), SINGLE),
    ("truncated-by-one-byte", "single", cut(lambda n: n - 1), SINGLE),
    ("garbage", "single", write(bytes(range(256)) * 40), SINGLE),
    ("huge-header-length", "single", write(struct.pack("<Q", 2 ** 63) + b"{}"), SINGLE),
    ("header-longer-than-file", "single", write(struct.pack("<Q", 1000) + b"{}"), SINGLE),
    ("header-not-json", "single", with_header(b"this is not json at all!"), SINGLE),
    ("header-not-utf8", "single", with_header(b"\xff\xfe\xfd{}"), SINGLE),
    ("header-a-list", "single", with_header([1, 2, 3]), SINGLE),
    ("header-entry-without-offsets", "single",
     edit_header(lambda h: h["model.norm.weight"].pop("data_offsets")), SINGLE),
    ("header-offsets-past-end", "single",
     edit_header(lambda h: h["model.norm.weight"].update(data_offsets=[0, 10 ** 9])), SINGLE),
    ("weights-a-directory", "single", lambda p: ((p / SINGLE).unlink(), (p / SINGLE).mkdir()), SINGLE),
    # sharded index broken in every way
    ("index-not-json", "sharded", write(b"{not json", INDEX), INDEX),
    ("index-empty", "sharded", write(b"", INDEX), INDEX),
    ("index-not-utf8", "sharded", write(b"\xff\xfe{}", INDEX), INDEX),
    ("index-a-list", "sharded", write(b"[1, 2]", INDEX), INDEX),
    ("index-without-weight-map", "sharded", write(b'{"metadata": {}}', INDEX), INDEX),
    ("index-weight-map-a-list", "sharded", write(b'{"weight_map": ["a"]}', INDEX), INDEX),
    ("index-weight-map-numbers", "sharded", write(b'{"weight_map": {"model.norm.weight": 3}}', INDEX), INDEX),
    ("index-names-missing-shard", "sharded", remove_shard(1), "which is not in"),
    ("index-names-unknown-shard", "sharded",
     edit_index(lambda ix: ix["weight_map"].update({"model.norm.weight": "nowhere.safetensors"})),
     "nowhere.safetensors"),
    ("index-names-shard-outside", "sharded",
     edit_index(lambda ix: ix["weight_map"].update({"model.norm.weight": "../x.safetensors"})), "../x.safetensors"),
    ("index-wrong-shard-norm", "sharded", move_to_other_shard("model.norm.weight"), "model.norm.weight"),
    ("index-wrong-shard-embed", "sharded", move_to_other_shard("model.embed_tokens.weight"),
     "model.embed_tokens.weight"),
    ("index-tensor-in-no-shard", "sharded",
     edit_index(lambda ix: ix["weight_map"].update({"model.extra.weight": shards_of(ix)[0]})), "model.extra.weight"),
    ("shard-zero-bytes", "sharded", on_shard(0, lambda s: write(b"", s)), "model-0000"),
    ("shard-truncated", "sharded", on_shard(1, lambda s: cut(lambda n: n // 2, s)), "model-0000"),
    ("shard-garbage", "sharded", on_shard(2, lambda s: write(b"\x01" * 500, s)), "model-0000"),
    # the config and the weights disagree
    ("more-layers-than-config", "single", edit_config(num_hidden_layers=2), L + "2."),
    ("fewer-layers-than-config", "single", edit_config(num_hidden_layers=4), L + "3."),
    ("missing-tensor", "single", drop(L + "1.self_attn.v_proj.weight"), L + "1.self_attn.v_proj.weight"),
    ("missing-lm-head", "single", drop("lm_head.weight"), "lm_head.weight"),
    ("missing-final-norm", "single", drop("model.norm.weight"), "model.norm.weight"),
    ("unknown-extra-tensor", "single", add("model.something.weight", (4,)), "model.something.weight"),
    ("bias-the-config-lacks", "single", add(L + "0.self_attn.q_proj.bias", (64,)), "q_proj.bias"),
    ("kv-split-at-wrong-row", "single", resplit(L + "0.self_attn.k_proj.weight", L + "0.self_attn.v_proj.weight", 16),
     "k_proj.weight has shape (16, 64), the config implies (32, 64)"),
    ("qk-split-at-wrong-row", "single", resplit(L + "2.self_attn.q_proj.weight", L + "2.self_attn.k_proj.weight", 16),
     "q_proj.weight has shape (48, 64)"),
    ("gate-up-split-at-wrong-row", "single", resplit(L + "1.mlp.gate_proj.weight", L + "1.mlp.up_proj.weight", 8),
     "gate_proj.weight has shape (120, 64)"),
    ("wrong-o-proj-shape", "single", replace(L + "0.self_attn.o_proj.weight", (64, 32)), "o_proj.weight"),
    ("wrong-trailing-dim", "single", replace(L + "0.self_attn.q_proj.weight", (64, 32)), "q_proj.weight"),
    ("vector-for-a-matrix", "single", replace(L + "0.mlp.down_proj.weight", (64,)), "down_proj.weight"),
    ("wrong-vocab-in-config", "single", edit_config(vocab_size=200), "embed_tokens.weight"),
    ("wrong-d-ff-in-config", "single", edit_config(intermediate_size=96), "up_proj.weight"),
    ("integer-weights", "single", replace(L + "0.input_layernorm.weight", (64,), torch.int32), "int32"),
    # numbers that are not finite
    ("nan-weight", "single", set_value(L + "1.self_attn.q_proj.weight", float("nan")), "q_proj.weight"),
    ("inf-weight", "single", set_value(L + "2.mlp.down_proj.weight", float("inf")), "down_proj.weight"),
    ("minus-inf-norm", "single", set_value("model.norm.weight", float("-inf"), 3), "model.norm.weight"),
    ("nan-embedding", "single", set_value("model.embed_tokens.weight", float("nan")), "embed_tokens.weight"),
    ("nan-in-fused-part", "single", set_value(L + "0.self_attn.v_proj.weight", float("nan")), "v_proj.weight"),
    ("rope-theta-negative", "single", lambda p: edit_config(rope_parameters={
        **json.loads((p / "config.json").read_text())["rope_parameters"], "rope_theta": -1.0})(p), "rope_theta"),
]


def shards_of(index) -> list[str]:
    return sorted(set(index["weight_map"].values()))


def run(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["verify", "generate"])
@pytest.mark.parametrize("case,base,breaks,named", CASES, ids=[c[0] for c in CASES])
def test_bad_checkpoint_is_one_line(bases, tmp_path, capsys, command, case, base, breaks, named):
    path = tmp_path / "ckpt"
    shutil.copytree(bases / base, path)
    breaks(path)
    argv = [command, str(path)] + (["--prompt-ids", "1,2"] if command == "generate" else [])
    code, err = run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert 1 <= len(lines) <= 2 and lines[0].startswith("kvwall: error: "), err
    assert named in err and "Traceback" not in err, err


@pytest.mark.slow
def test_a_value_too_large_for_float16_is_named(bases, tmp_path, capsys):
    """1e6 is a finite float32 but inf in float16: loading as float16 says so instead of printing garbage."""
    path = tmp_path / "ckpt"
    shutil.copytree(bases / "single", path)
    set_value(L + "1.mlp.up_proj.weight", 1e6)(path)
    code, err = run(["generate", str(path), "--prompt-ids", "1,2", "--dtype", "float16"], capsys)
    assert code == 2 and "too large for torch.float16" in err and "up_proj.weight" in err, err
    assert run(["generate", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "2"], capsys)[0] == 0


def test_tensors_the_engine_may_ignore_still_load(bases, tmp_path, capsys):
    """Rotary inv_freq buffers and a saved copy of a tied LM head are not 'unexpected'; verify passes."""
    path = tmp_path / "ckpt"
    shutil.copytree(bases / "single", path)

    def fn(state):
        for i in range(3):
            state[f"{L}{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    edit_state(fn)(path)
    edit_config(tie_word_embeddings=True)(path)
    code, _ = run(["verify", str(path), "--prompt-ids", "1,2,3"], capsys)
    assert code == 0


def test_gpt2_mask_buffers_are_ignored(tmp_path, capsys):
    make_checkpoint("gpt2", tmp_path)

    def fn(state):
        for i in range(3):
            state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
            state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    edit_state(fn)(tmp_path)
    assert run(["verify", str(tmp_path), "--prompt-ids", "1,2,3"], capsys)[0] == 0


def test_a_sharded_checkpoint_still_loads(bases, capsys):
    assert run(["verify", str(bases / "sharded"), "--prompt-ids", "1,2,3"], capsys)[0] == 0
