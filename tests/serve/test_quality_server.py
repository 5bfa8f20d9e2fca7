"""`kvwall quality MODEL --server URL` (issue #44): quality's perplexity through a server's prompt logprobs equals
the engine's own exact-cache run on the same rows, and top-1 accuracy equals transformers' argmax by hand."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from kvwall.cli import main  # noqa: E402
from kvwall.engine.tokenizer import Text  # noqa: E402
from kvwall.measure import quality  # noqa: E402
from kvwall.serve import serving_in_thread  # noqa: E402
from kvwall.serve.runner import Runner  # noqa: E402
from kvwall.serve.server import Api  # noqa: E402
from kvwall.serve.worker import Worker  # noqa: E402

VOCAB = 160


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory):
    """The tiny llama with a word-level tokenizer.json beside it (w0..w159), and a text of 600 random words."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    src, model = tiny_model("llama")
    ckpt = tmp_path_factory.mktemp("ckpt") / "tiny"
    shutil.copytree(src, ckpt)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    rng = random.Random(4)
    text = ckpt.parent / "text.txt"
    text.write_text(" ".join(f"w{rng.randrange(1, VOCAB)}" for _ in range(600)))
    return ckpt, model, Text(ckpt / "tokenizer.json"), text


@pytest.mark.slow
def test_quality_through_a_server_equals_the_engines_exact_cache(tiny, capsys):
    ckpt, model, tok, text = tiny
    runner = Runner(model, n_blocks=200, block_size=8, chunk=24, max_batch=4)  # rows of 128 in 6 chunks
    with serving_in_thread(Api(Worker(runner), tok, "tiny").app()) as url:
        args = ["quality", str(ckpt), "--server", url, "--text", str(text), "--tokens", "512", "--rows", "4",
                "--prefill", "8", "--no-passkey", "--json"]
        assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    plan = quality.Plan(["contiguous"], 512, 4, 8, 32, None)
    exact = quality.measure(model, tok, plan, text.read_text(), "text")["quality"][0]
    row = got["quality"][0]
    assert row["predictions"] == exact["predictions"] == 4 * (128 - 1 - 8)
    assert row["ppl"] == pytest.approx(exact["ppl"], rel=1e-5)
    # top-1 accuracy by hand: transformers' argmax at each scored position against the text's next token
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = quality.split_rows(quality.Tokens(tok).plain(text.read_text()), 512, 4, [])  # (4, 128)
    with torch.no_grad():
        best = hf(ids).logits.argmax(-1)  # (4, 128)
    hits = sum(int(best[r, t - 1] == ids[r, t]) for r in range(4) for t in range(9, 128))
    assert row["top1_accuracy"] == pytest.approx(hits / row["predictions"])


def test_quality_server_refuses_engine_options_and_a_dead_server(tiny, capsys):
    ckpt, _, _, text = tiny
    assert main(["quality", str(ckpt), "--server", "http://127.0.0.1:9", "--cache", "int8", "--text", str(text)]) == 2
    assert "--cache is for the engine's own run" in capsys.readouterr().err
    assert main(["quality", str(ckpt), "--server", "http://127.0.0.1:9", "--text", str(text), "--tokens", "256",
                 "--no-passkey"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwall: error: --server http://127.0.0.1:9") and "is the server up?" in err
    assert err.count("\n") == 1
