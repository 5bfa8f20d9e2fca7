"""Hostile and inconsistent model files (issue #38): a .gguf whose chat template tries to run code, whose
header declares absurd lengths, whose tokenizer fields are missing or malformed, whose metadata contradicts
its own tensors; a broken tokenizer.json beside a safetensors checkpoint; a tied config whose file also holds
lm_head.weight. Each is one clean line naming the file and the field (exit 2 through the CLI, no traceback),
or the answer transformers gives. The files are test_gguf's tiny llama, rewritten with one thing changed."""

from __future__ import annotations

import json
import struct
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
np = pytest.importorskip("numpy")

from test_gguf import MERGES, Q, tiny_hf, write_gguf  # noqa: E402

from kvwall.cli import main  # noqa: E402
from kvwall.engine.gguf_tokenizer import gguf_tokenizer  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402

T = gguf.GGUFValueType
HIDDEN, VOCAB = 64, 288  # test_gguf.tiny_hf("llama"): 2 layers, 4 query and 2 K/V heads of 16, d_ff 128


# -- files -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny llama of test_gguf in F32 (tensors stored as plain float arrays, easy to rewrite)."""
    path = tmp_path_factory.mktemp("hostile") / "base.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", Q.F32)
    return path


def rewrite(src, dst, fields=None, tensors=None):
    """src's metadata and tensors written to dst, with fields[key] = None (dropped), a value (type as the
    writer infers it) or (value, type[, element type]); tensors[name] = None (dropped) or a new float32 array
    (in PyTorch's order, as the reader serves it)."""
    fields, tensors = fields or {}, tensors or {}
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    kept = {k: (f.contents(), f.types[0], f.types[-1] if f.types[0] == T.ARRAY else None)
            for k, f in reader.fields.items() if not k.startswith("GGUF.") and k != "general.architecture"}
    for key, value in {**kept, **fields}.items():
        if value is None:
            continue
        if not isinstance(value, tuple):
            value = (value, T.get_type(value), None if not isinstance(value, list) else T.get_type(value[0]))
        w.add_key_value(key, value[0], value[1], value[2] if len(value) > 2 else None)
    for t in reader.tensors:
        x = tensors.get(t.name, np.array(t.data))
        if x is not None:
            w.add_tensor(t.name, np.ascontiguousarray(x, dtype=np.float32))
    for name, x in tensors.items():
        if x is not None and name not in {t.name for t in reader.tensors}:
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def cli(capsys, *argv):
    """(exit status, stdout, stderr) of `kvwall argv`."""
    capsys.readouterr()  # what came before (a fixture's progress bars) is not the command's
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc, err, *words):
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


def raw_gguf(*kvs: bytes, n_kv=None, n_tensors=0, tail=b"\0" * 64) -> bytes:
    """A GGUF v3 header written by hand (little-endian): magic, version, tensor and KV counts, the KVs."""
    counts = struct.pack("<IQQ", 3, n_tensors, len(kvs) if n_kv is None else n_kv)
    return b"GGUF" + counts + b"".join(kvs) + tail


def gstr(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


ARCH_KV = gstr("general.architecture") + struct.pack("<I", 8) + gstr("llama")  # type 8: string


# -- 1, 2: the chat template runs in a sandbox; its failures are one line ------------

EXPLOITS = ["{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
            "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
            "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}",
            "{% set ns = namespace(__class__=1) %}{{ lipsum.__globals__.os.system('touch MARKER') }}"]


def evil(base, tmp_path, template: str, marker):
    """base with a chat template that would touch `marker` if it could run a command."""
    fields = {"tokenizer.chat_template": template.replace("MARKER", str(marker))}
    return rewrite(base, tmp_path / "evil.gguf", fields=fields)


@pytest.mark.slow
@pytest.mark.parametrize("template", EXPLOITS, ids=["cycler", "context", "joiner", "namespace"])
def test_chat_template_cannot_run_commands(base, tmp_path, template):
    marker = tmp_path / "PWNED"
    path = evil(base, tmp_path, template, marker)
    with pytest.raises(KvwallError, match="evil.gguf: tokenizer.chat_template tried to reach outside its sandbox"):
        gguf_tokenizer(path).chat([{"role": "user", "content": "hi"}])
    assert not marker.exists()


@pytest.mark.parametrize("template", EXPLOITS[:3], ids=["cycler", "context", "joiner"])
def test_the_exploits_run_in_a_plain_environment(tmp_path, template):
    """What kvwall did before: a plain jinja2.Environment runs the command (so the tests above test something)."""
    import jinja2

    marker = tmp_path / "PWNED"
    jinja2.Environment().from_string(template.replace("MARKER", str(marker))).render(messages=[])
    assert marker.exists()


def test_cli_generate_chat_refuses_the_exploit(base, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    path = evil(base, tmp_path, EXPLOITS[0], marker)
    rc, _, err = cli(capsys, "generate", path, "--chat", "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line(rc, err, "evil.gguf", "tokenizer.chat_template", "sandbox")
    assert not marker.exists()


@pytest.mark.slow
def test_served_chat_refuses_the_exploit(base, tmp_path):
    """`kvwall serve FILE.gguf`: one POST /v1/chat/completions rendered the template inside the server."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from kvwall.serve import serving_in_thread
    from kvwall.serve.runner import Runner
    from kvwall.serve.server import Api
    from kvwall.serve.worker import Worker

    marker = tmp_path / "PWNED"
    path = evil(base, tmp_path, EXPLOITS[0], marker)
    runner = Runner(load_model(path), n_blocks=16, block_size=4, chunk=16, max_batch=2)
    with serving_in_thread(Api(Worker(runner), gguf_tokenizer(path), "evil").app()) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "evil", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400, r.text
        assert "tokenizer.chat_template" in r.json()["error"]["message"]
        ok = httpx.post(url + "/v1/completions", timeout=60, json={"model": "evil", "prompt": "the cat",
                                                                   "max_tokens": 2})
        assert ok.status_code == 200  # the server survives and serves plain prompts
    assert not marker.exists()


# What real templates use: namespace, loop controls, tojson (non-ASCII and HTML kept), dict, the
# {% generation %} block, an undefined `tools` (rendered empty, tested false), raise_exception on a bad role.
TEMPLATE = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
            "{{ raise_exception('bad role ' + m['role']) }}{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}"
            "{% set ns.n = ns.n + 1 %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] | tojson }}{% endif %}\n{% endfor %}"
            "{{ tools }}{% if not tools %}[{{ ns.n }} {{ dict(a=1)['a'] }}]{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MESSAGES = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "dropped by the break"}]


def test_real_template_features_render_as_transformers_renders_them(base, tmp_path):
    path = rewrite(base, tmp_path / "t.gguf", fields={"tokenizer.chat_template": TEMPLATE})
    got = gguf_tokenizer(path).chat(MESSAGES)
    assert got == '<user>"héllo <b>"<assistant>ok[2 1]<assistant>'  # by hand (trim_blocks eats each "\n")
    from transformers.utils.chat_template_utils import _compile_jinja_template

    want = _compile_jinja_template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True,
                                                    bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m['content'] }", ["syntax error on line 1"]),
    ("{{ undefined_function() }}", ["UndefinedError", "'undefined_function' is undefined"]),
    ("{{ undefined_thing.attribute }}", ["UndefinedError"]),
    ("{{ 1 + 'a' }}", ["TypeError"]),
    ("{{ raise_exception('roles must alternate') }}", ["refused the messages: roles must alternate"]),
], ids=["syntax", "call-undefined", "attribute-of-undefined", "type-error", "raise_exception"])
def test_chat_template_failures_are_one_line(base, tmp_path, capsys, template, words):
    path = rewrite(base, tmp_path / "t.gguf", fields={"tokenizer.chat_template": template})
    rc, _, err = cli(capsys, "generate", path, "--chat", "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line(rc, err, "t.gguf", "tokenizer.chat_template", *words)
    rc, _, err = cli(capsys, "generate", path, "--prompt", "hi", "--max-new-tokens", "2")
    assert rc == 0, err  # a broken template matters only to --chat


def test_an_old_jinja2_is_refused(base, tmp_path, monkeypatch):
    """jinja2 before 3.1.6 has known sandbox escapes (transformers refuses it too)."""
    import jinja2

    path = rewrite(base, tmp_path / "t.gguf", fields={"tokenizer.chat_template": "{{ messages[0]['content'] }}"})
    tok = gguf_tokenizer(path)
    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    with pytest.raises(KvwallError, match="needs jinja2 3.1.6 or later"):
        tok.chat([{"role": "user", "content": "hi"}])
    monkeypatch.setattr(jinja2, "__version__", "3.1.6")
    assert tok.chat([{"role": "user", "content": "hi"}]) == "hi"


# -- 3: the tokenizer's fields, each checked -----------------------------------

def _tokens(base) -> list[str]:
    return gguf.GGUFReader(base).fields["tokenizer.ggml.tokens"].contents()


TOKENIZER_CASES = {
    "no-merges": (lambda toks: {"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing"),
    "no-tokens": (lambda toks: {"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
    "no-scores": (lambda toks: {"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.scores is missing"),
    "merge-without-space": (lambda toks: {"tokenizer.ggml.merges": ["Ġt", *MERGES[1:]]},
                            "tokenizer.ggml.merges[0] is 'Ġt', not two tokens joined by a space"),
    "merge-of-unknown-token": (lambda toks: {"tokenizer.ggml.merges": ["Ġ zz", *MERGES[1:]]},
                               "(tokenizer.ggml.*) cannot be built (Error while initializing BPE: Token `zz`"),
    "fewer-tokens-than-rows": (lambda toks: {"tokenizer.ggml.tokens": toks[:280],
                                             "tokenizer.ggml.token_type": [3, 3, 3] + [1] * 277},
                               "tokenizer.ggml.tokens holds 280 tokens, tensor token_embd.weight has 288 rows"),
    "more-tokens-than-rows": (lambda toks: {"tokenizer.ggml.tokens": toks + ["x", "y"]},
                              "tokenizer.ggml.tokens holds 290 tokens, tensor token_embd.weight has 288 rows"),
    "invalid-utf8": (lambda toks: {"tokenizer.ggml.tokens": toks[:-1] + [b"\xff\xfe"]},
                     "tokenizer.ggml.tokens[287] is not valid UTF-8"),
    "types-as-strings": (lambda toks: {"tokenizer.ggml.token_type": ["1"] * VOCAB},
                         "tokenizer.ggml.token_type is an array of string values, not an array of numbers"),
    "types-too-few": (lambda toks: {"tokenizer.ggml.token_type": [1] * 100},
                      "tokenizer.ggml.token_type holds 100 values for 288 tokens"),
    "model-not-a-string": (lambda toks: {"tokenizer.ggml.model": (7, T.UINT32)},
                           "tokenizer.ggml.model is 7, not a string"),
    "pre-an-array": (lambda toks: {"tokenizer.ggml.pre": ["a", "b"]}, "tokenizer.ggml.pre is ['a', 'b'], not a string"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_broken_tokenizer_fields_are_one_line(base, tmp_path, capsys, case):
    fields, words = TOKENIZER_CASES[case]
    path = rewrite(base, tmp_path / "tok.gguf", fields=fields(_tokens(base)))
    rc, _, err = cli(capsys, "generate", path, "--prompt", "the cat", "--max-new-tokens", "2")
    assert_one_line(rc, err, "tok.gguf", words)
    rc, out, err = cli(capsys, "generate", path, "--prompt-ids", "5,6", "--max-new-tokens", "2")
    assert rc == 0 and "warning" in err and words in err, err  # the model is fine: ids need no tokenizer
    assert len(out.strip().split(",")) == 2  # the new ids, printed as ids


# -- 4, 7: the metadata against the file's own tensors ---------------------------

METADATA_CASES = {  # fields or tensors changed -> words of the error; the file holds 2 blocks of 4 heads of 16
    "rope-odd": ({"llama.rope.dimension_count": (7, T.UINT32)}, None,
                 ["llama.rope.dimension_count is 7", "even"]),
    "rope-wider-than-head": ({"llama.rope.dimension_count": (32, T.UINT32)}, None,
                             ["llama.attention.head_count 4 x head width (llama.rope.dimension_count) 32 = 128",
                              "blk.0.attn_q.weight has 64 rows"]),
    "feed-forward": ({"llama.feed_forward_length": (96, T.UINT32)}, None,
                     ["llama.feed_forward_length is 96", "blk.0.ffn_up.weight has 128 rows"]),
    "embedding": ({"llama.embedding_length": (32, T.UINT32)}, None,
                  ["llama.embedding_length is 32", "token_embd.weight has 64 columns"]),
    "more-blocks": ({"llama.block_count": (3, T.UINT32)}, None, ["llama.block_count is 3", "no tensors blk.2.*"]),
    "fewer-blocks": ({"llama.block_count": (1, T.UINT32)}, None,
                     ["llama.block_count is 1", "holds tensor blk.1.attn_q.weight"]),
    "vocab": ({"llama.vocab_size": (300, T.UINT32)}, None,
              ["llama.vocab_size is 300", "token_embd.weight has 288 rows"]),
    "kv-heads": ({"llama.attention.head_count_kv": (4, T.UINT32)}, None,
                 ["llama.attention.head_count_kv 4 x", "= 64", "blk.0.attn_k.weight has 32 rows"]),
    "missing-tensor": (None, {"blk.1.attn_q.weight": None}, ["tensor 'blk.1.attn_q.weight' missing"]),
    "missing-norm": (None, {"output_norm.weight": None}, ["tensor 'output_norm.weight' missing"]),
    "name-not-utf8": ({"general.name": b"\xff\xfe"}, None, ["general.name is not valid UTF-8"]),
    "mis-shaped-tensor": (None, {"blk.1.ffn_down.weight": np.zeros((HIDDEN, 96))},
                          ["blk.1.ffn_down.weight has shape (64, 96), the config implies (64, 128)"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_show_refuses_metadata_its_tensors_contradict(base, tmp_path, capsys, case):
    """`kvwall show` printed parameter counts from such metadata (rope 7: an AssertionError in generate)."""
    fields, tensors, words = METADATA_CASES[case]
    path = rewrite(base, tmp_path / "m.gguf", fields=fields, tensors=tensors)
    for command in (["show", path], ["generate", path, "--prompt-ids", "5,6", "--max-new-tokens", "2"]):
        rc, out, err = cli(capsys, *command)
        assert_one_line(rc, err, "m.gguf", *words)
        assert out == ""


def test_show_still_shows_a_consistent_file(base, capsys):
    rc, out, err = cli(capsys, "show", base, "--json")
    assert rc == 0, err
    # by hand: 2 x (q 64x64 + k, v 32x64 + o 64x64 + gate, up 128x64 + down 64x128 + 2 norms of 64)
    # + embeddings and head 288x64 + the final norm 64
    layer = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64 + 2 * 64
    assert json.loads(out)["params"] == 2 * layer + 2 * 288 * 64 + 64


# -- 5: a tokenizer.json that is not one ------------------------------------------

@pytest.mark.parametrize("text", ["{garbage", "{}"])
def test_broken_tokenizer_json_is_one_line(checkpoint, tmp_path, capsys, text):
    import shutil

    src, _ = checkpoint("llama")
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    (path / "tokenizer.json").write_text(text)
    rc, _, err = cli(capsys, "generate", path, "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line(rc, err, "tokenizer.json", "re-download")


# -- 6: declared lengths past the file's end ----------------------------------------

HEADERS = {  # a header as written -> the field named
    "array-of-2^61": (raw_gguf(ARCH_KV, gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 0, 2 ** 61)),
                      "tokenizer.ggml.tokens declares 2,305,843,009,213,693,952 array elements"),
    "strings-of-2^61": (raw_gguf(ARCH_KV, gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2 ** 61)),
                        "tokenizer.ggml.tokens declares 2,305,843,009,213,693,952 array elements"),
    "string-of-2^60": (raw_gguf(ARCH_KV, gstr("general.name") + struct.pack("<IQ", 8, 2 ** 60)),
                       "general.name declares 1,152,921,504,606,846,976 bytes of text"),
    "kv-count": (raw_gguf(ARCH_KV, n_kv=2 ** 40), "GGUF.kv_count declares 1,099,511,627,776 metadata entries"),
    "tensor-count": (raw_gguf(ARCH_KV, n_tensors=2 ** 40), "GGUF.tensor_count declares 1,099,511,627,776 tensors"),
    "tensor-past-the-end": (raw_gguf(ARCH_KV, n_tensors=1, tail=gstr("token_embd.weight") + struct.pack(
        "<IQQIQ", 2, 2 ** 32, 2 ** 32, 0, 0) + b"\0" * 64), "tensor token_embd.weight declares"),
    "nested-arrays": (raw_gguf(ARCH_KV, gstr("x.y") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) * 1000),
                      "x.y nests arrays more than 4 deep"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HEADERS))
def test_absurd_declared_lengths_are_refused_at_once(tmp_path, capsys, case):
    """Such a header hung `kvwall show` and ran `generate` out of memory after 48 s."""
    data, words = HEADERS[case]
    path = tmp_path / "bomb.gguf"
    path.write_bytes(data)
    cli(capsys, "show", path)  # imports the gguf package once, outside the timing
    for command in (["show", path], ["generate", path, "--prompt-ids", "1,2"]):
        t0 = time.perf_counter()
        rc, _, err = cli(capsys, *command)
        assert time.perf_counter() - t0 < 1.0
        assert_one_line(rc, err, "bomb.gguf", words)


def test_more_array_elements_than_kvwall_reads(tmp_path):
    """An honest 5,000,000-element array: the gguf package would keep a numpy view per element (GBs)."""
    from kvwall.spec.gguf_meta import ARRAY_LIMIT, read_meta

    assert ARRAY_LIMIT < 5_000_000
    path = tmp_path / "big.gguf"
    path.write_bytes(raw_gguf(ARCH_KV, gstr("x.big") + struct.pack("<IIQ", 9, 0, 5_000_000) + b"\1" * 5_000_000))
    with pytest.raises(KvwallError, match="x.big brings the header's array elements to 5,000,000"):
        read_meta(path)


# -- 8: a tied config whose file also holds lm_head.weight ---------------------------

@pytest.mark.slow
def test_tied_config_with_its_own_lm_head_loads_as_transformers_does(tmp_path):
    """transformers 5.25 loads a saved lm_head.weight that differs from the embedding as the head (untied, with a
    warning); an equal copy stays tied."""
    from safetensors.torch import load_file, save_file
    from tiny_checkpoints import ids, make_checkpoint

    path = tmp_path / "tied"
    make_checkpoint("llama", path, config={"tie_word_embeddings": True})
    state = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in state
    tied = load_model(path)
    x = ids(1, 12)
    with torch.no_grad():
        before = tied(x)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # an equal copy: still the tie
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    assert load_model(path).lm_head is None
    g = torch.Generator().manual_seed(3)
    state["lm_head.weight"] = 0.08 * torch.randn(state["lm_head.weight"].shape, generator=g)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    mine = load_model(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        got, want = mine(x), ref(x).logits
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - before).abs().max().item() > 0.1  # the head is the file's, not the embedding
