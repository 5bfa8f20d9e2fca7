"""lm-evaluation-harness against `kvwall serve` (issue #44): its `local-completions` model runs a loglikelihood task
and a generate_until task from local JSONL files, with its default token-id requests (batched: a list of token-id
lists per request), and its perplexity is held against `kvwall quality`'s exact-cache perplexity on the same text
(and `kvwall quality --server` against the same server).

The loglikelihood task is built from the rows `kvwall quality` scores: the text's first --tokens tokens in --rows
rows; quality prefills each row's first --prefill tokens, then scores tokens prefill + 1 .. L - 1, each predicted
from all before it. Here each row is a document whose context is the text of its first prefill + 1 tokens and
whose continuation is the text of the rest (target_delimiter ""), so lm-eval sends the same tokens (checked: the
script re-encodes them as lm-eval does) and its summed loglikelihoods give the same perplexity.

lm-eval runs from its own virtual environment (not a project dependency):
    python3 -m venv /work/venvs/lmeval && /work/venvs/lmeval/bin/pip install "lm_eval[api]" transformers

    python benchmarks/lmeval_serve.py                       # smollm2-135m, writes benchmarks/results/lmeval_serve.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvwall.serve import free_port

HERE = Path(__file__).parent
LMEVAL = "/work/venvs/lmeval/bin/lm_eval"
QUESTIONS = [  # generate_until: a few facts the 135M instruct model may or may not know; the run is the point
    ("The capital of France is", "Paris"),
    ("Two plus two equals", "four"),
    ("The opposite of hot is", "cold"),
    ("The color of the sky on a clear day is", "blue"),
]


def write_tokenizer(path: Path, out: Path) -> None:
    """The .gguf's tokenizer (kvwall rebuilds it from the file's metadata) as a transformers tokenizer directory,
    for lm-eval's huggingface tokenizer backend: the same ids kvwall serve encodes."""
    from kvwall.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    out.mkdir(parents=True, exist_ok=True)
    tok.tok.save(str(out / "tokenizer.json"))
    eos = tok.tok.id_to_token(2) if tok.tok.id_to_token(2) else None  # SmolLM2: <|im_end|> is id 2
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": eos, "add_bos_token": False}))


def quality_rows(path: Path, tokens: int, rows: int, prefill: int):
    """(the rows quality scores, as token-id lists, and a tokenizer), from kvwall.measure.quality itself."""
    from kvwall.engine.tokenizer import load_tokenizer
    from kvwall.measure.quality import Tokens, read_text, split_rows

    tok = Tokens(load_tokenizer(path))
    text, source = read_text(None)
    return split_rows(tok.plain(text), tokens, rows, tok.prefix).tolist(), tok, source


def write_tasks(folder: Path, docs: list[dict]) -> None:
    (folder / "ppl.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in QUESTIONS))
    (folder / "kvwall_ppl.yaml").write_text(f"""task: kvwall_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'ppl.jsonl'}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:  # lm-eval's perplexity is exp(-mean loglikelihood of a document): 239-token rows overflow it
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (folder / "kvwall_gen.yaml").write_text(f"""task: kvwall_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(\\\\w+)"
      - function: take_first
""")


def wait_healthy(url: str, proc: subprocess.Popen, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvwall serve exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"kvwall serve did not answer within {limit_s:g} s")


def quality_ppl(model: str, a) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvwall", "quality", model, "--cache", "contiguous", "--no-passkey",
                          "--tokens", str(a.tokens), "--rows", str(a.rows), "--prefill", str(a.prefill), "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prefill", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4, help="prompts per lm-eval request (a list of id lists)")
    p.add_argument("--concurrent", type=int, default=2, help="lm-eval requests in flight at once")
    p.add_argument("--quality-json", metavar="FILE", help="reuse the output of `kvwall quality MODEL --cache "
                   "contiguous --no-passkey --json` (same --tokens, --rows, --prefill) instead of running it")
    p.add_argument("--out", default=str(HERE / "results" / "lmeval_serve.json"))
    a = p.parse_args()

    from kvwall.commands.engine_cmds import _checkpoint

    path = _checkpoint(a.model)
    rows, tok, source = quality_rows(path, a.tokens, a.rows, a.prefill)
    cut = a.prefill + 1  # quality feeds tokens 0..prefill before it scores token prefill + 1
    docs = [{"context": tok.decode(r[:cut]), "continuation": tok.decode(r[cut:])} for r in rows]
    same = [tok.plain(d["context"] + d["continuation"]) == r and tok.plain(d["context"]) == r[:cut]
            for d, r in zip(docs, rows)]
    scored = sum(len(r) - cut for r in rows)

    t0 = time.perf_counter()
    q = json.loads(Path(a.quality_json).read_text()) if a.quality_json else quality_ppl(a.model, a)
    quality_s = q.get("seconds", time.perf_counter() - t0)
    assert (q["text"]["rows"], q["text"]["row_tokens"], q["text"]["prefill"]) == (a.rows, len(rows[0]), a.prefill)
    exact = next(r for r in q["quality"] if r["cache"] == "contiguous")

    work = Path(tempfile.mkdtemp(prefix="lmeval_serve_"))
    write_tokenizer(path, work / "tokenizer")
    write_tasks(work, docs)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen([sys.executable, "-m", "kvwall", "serve", a.model, "--port", str(port), "--name", "smol",
                              "--kv-memory", "256MiB"], stderr=open(work / "serve.log", "w"))  # never a full pipe
    try:
        wait_healthy(url, serve)
        args = (f"model=smol,base_url={url}/v1/completions,tokenizer={work / 'tokenizer'},"
                f"tokenizer_backend=huggingface,num_concurrent={a.concurrent},"
                "max_retries=1,timeout=600")
        t0 = time.perf_counter()
        run = subprocess.run([LMEVAL, "run", "--model", "local-completions", "--model_args", args, "--tasks",
                              "kvwall_ppl,kvwall_gen", "--batch_size", str(a.batch_size), "--include_path",
                              str(work), "--output_path",
                              str(work / "out"), "--log_samples"], capture_output=True, text=True,
                             env=dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"))
        lmeval_s = time.perf_counter() - t0
        if run.returncode:
            print(run.stdout[-3000:], run.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"lm-eval exited with status {run.returncode}")
        metrics = metrics_text = None
        for name in glob.glob(str(work / "out" / "**" / "results_*.json"), recursive=True):
            metrics = json.loads(Path(name).read_text())["results"]
        samples = {}
        for name in glob.glob(str(work / "out" / "**" / "samples_*.jsonl"), recursive=True):
            task = "kvwall_ppl" if "kvwall_ppl" in name else "kvwall_gen"
            samples[task] = [json.loads(line) for line in Path(name).read_text().splitlines()]
        loglik = sum(float(s["resps"][0][0][0]) for s in samples["kvwall_ppl"])  # logged as text
        ppl = math.exp(-loglik / scored)
        gens = [{"prompt": s["doc"]["q"], "answer": s["doc"]["a"], "generated": s["resps"][0][0],
                 "exact_match": s["exact_match"]} for s in samples["kvwall_gen"]]
        metrics_text = run.stdout[-2000:]
        served = subprocess.run([sys.executable, "-m", "kvwall", "quality", a.model, "--server", url, "--no-passkey",
                                 "--tokens", str(a.tokens), "--rows", str(a.rows), "--prefill", str(a.prefill),
                                 "--json"], capture_output=True, text=True, check=True)
        served_ppl = json.loads(served.stdout)["quality"][0]["ppl"]
    finally:
        serve.terminate()
        serve.wait(30)
    result = {
        "what": "lm-evaluation-harness local-completions (token-id, batched requests) against kvwall serve, vs "
                "kvwall quality's exact-cache perplexity on the same rows",
        "model": a.model, "text": source, "rows": a.rows, "tokens": a.tokens, "prefill": a.prefill,
        "scored_tokens": scored, "rows_reencode_identically": same,
        "lmeval": {"batch_size": a.batch_size, "num_concurrent": a.concurrent, "ppl": ppl, "loglikelihood": loglik,
                   "metrics": metrics, "generations": gens, "seconds": round(lmeval_s, 1)},
        "quality": {"ppl": exact["ppl"], "seconds": round(quality_s, 1),
                    "command": f"kvwall quality {a.model} --cache contiguous --no-passkey --tokens {a.tokens} "
                               f"--rows {a.rows} --prefill {a.prefill} --json"},
        "quality_server": {"ppl": served_ppl, "command": "kvwall quality MODEL --server URL --no-passkey"},
        "ratio": ppl / exact["ppl"], "within_1_percent": abs(ppl / exact["ppl"] - 1) < 0.01,
        "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(metrics_text)
    print(f"lm-eval ppl {ppl:.4f}  kvwall quality ppl {exact['ppl']:.4f}  ratio {result['ratio']:.5f}  "
          f"({scored} tokens; rows re-encode identically: {same}) -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
