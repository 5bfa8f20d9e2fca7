"""SmolLM2-135M's decode speed by weight format: kvwall holding the GGUF's weights as fp32 (dequantized), natively
(the file's own Q4_1 blocks and Q8_0 token table, repacked at load), int8 and int4:g128 (re-quantized from the
dequantized weights; `/q8_0` packs the token table and tied head too), against transformers in fp32 on the same
dequantized weights, and llama.cpp on the file itself at batch 1 when llama-cpp-python is installed.

    .venv/bin/python benchmarks/bench_real_decode.py [--batches 1,16]
        [--weights fp32,native,int8,int4:g128,int4:g128/q8_0] [--new 64] [--runs 3] [--threads 2]
        [--model smollm2-135m | path.gguf] [--no-llama-cpp] [--json benchmarks/results/real_decode_DATE.json]

Per batch: one random 16-token prompt (fixed seed); each engine prefills it, then 64 greedy decode steps are
timed as one run (the same window for every engine: its own one-token step and argmax, no sampler). The engines
take turns run by run, the order reversed every other round (benchmarks/fair.py: a busy machine slows them
alike), and each reports the median of --runs runs. Every engine computes on `--threads` threads (default 2, this
machine's cores): torch's (kvwall, transformers; one process) and llama.cpp's n_threads and n_threads_batch; each
row records the count given and the count the engine reports (torch.get_num_threads(), llama.cpp's context
n_threads). Prints a markdown table: decode tok/s (batch x new tokens / decode seconds), the ratio to transformers
measured in the same run, the bytes the engine holds for its weights, and whether its greedy tokens equal
transformers'; `--json` writes the rows with every run's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvwall.engine.layers.packed import packed_kernel, weight_bytes
from kvwall.engine.load import load_model
from kvwall.measure.real_worker import KvwallEngine, TransformersEngine, load_transformers
from kvwall.spec.gguf_meta import gguf_file

sys.path.insert(0, str(Path(__file__).parent))
import fair  # benchmarks/fair.py: the same threads for every engine, runs in turns


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python) on the .gguf itself, one sequence: prefill the prompt, then one token a
    step, greedy over the logits it returns (the same step/tokens interface as real_worker's engines)."""

    def __init__(self, llm, prompt: torch.Tensor):
        import numpy as np

        self.llm, self.np = llm, np
        llm.reset()
        llm.eval(prompt[0].tolist())
        self.tokens = [torch.tensor([[self._next()]])]

    def _next(self) -> int:
        # the last evaluated token's logits, as llama.cpp returns them (llama_get_logits: only the last token of a
        # batch has logits unless logits_all). Llama.scores holds them only with logits_all=True (llama-cpp-python
        # 0.3.x no longer copies them otherwise), which would also make a prefill compute the LM head at every token
        logits = self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))  # (V,)
        return int(self.np.argmax(logits))

    def step(self) -> None:
        self.llm.eval([int(self.tokens[-1])])
        self.tokens.append(torch.tensor([[self._next()]]))


def load_llama_cpp(path, n_ctx: int, threads: int):
    """A llama_cpp.Llama on the file on `threads` threads in decode and in prompt processing, or None when not
    installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)


def llama_threads(llm) -> int | None:
    """The decode threads llama-cpp-python holds for its context (None where this version keeps no such field)."""
    params = getattr(llm, "context_params", None)
    return getattr(params, "n_threads", None)


def one_run(make, new: int) -> tuple[float, torch.Tensor]:
    """(decode seconds for `new` tokens, the tokens (B, new + 1)) of a fresh engine from make()."""
    e = make()
    t0 = time.perf_counter()
    for _ in range(new):
        e.step()
    return time.perf_counter() - t0, torch.cat(e.tokens, 1)


@torch.inference_mode()
def bench_batch(models: dict, hf, batch: int, prompt_len: int, new: int, runs: int, llm=None,
                threads: int = fair.THREADS) -> list[dict]:
    prompt = torch.randint(0, 49152, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))  # (B, T)
    makers = {name: (lambda m=m: KvwallEngine(m, "contiguous", prompt, prompt_len + new + 1))
              for name, m in models.items()}
    if hf is not None:
        makers["transformers fp32"] = lambda: TransformersEngine(hf, prompt)
    if llm is not None and batch == 1:  # llama-cpp-python's Llama runs one sequence
        makers["llama.cpp (the file)"] = lambda: LlamaCppEngine(llm, prompt)
    times: dict[str, list[float]] = {k: [] for k in makers}
    tokens = {}
    for _, name in fair.turns(list(makers), runs):
        s, tokens[name] = one_run(makers[name], new)
        times[name].append(s)
    ref = tokens.get("transformers fp32")
    rows = []
    for name in makers:
        s = statistics.median(times[name])
        cpp = name.startswith("llama.cpp")
        rows.append({"engine": name, "batch": batch, "tok_s": batch * new / s, "runs_s": times[name],
                     "threads": threads, "threads_reported": llama_threads(llm) if cpp else torch.get_num_threads(),
                     "threads_reported_by": "llama.cpp context n_threads" if cpp else "torch.get_num_threads()",
                     "same_tokens": None if ref is None or name == "transformers fp32"
                     else bool(torch.equal(tokens[name], ref)),
                     "bytes": weight_bytes(models[name]) if name in models else None})
    base = next((r["tok_s"] for r in rows if r["engine"] == "transformers fp32"), None)
    cpp = next((r["tok_s"] for r in rows if r["engine"].startswith("llama.cpp")), None)
    for r in rows:
        r["vs_transformers"] = r["tok_s"] / base if base else None
        r["vs_llama_cpp"] = r["tok_s"] / cpp if cpp else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="fp32,native,int8,int4:g128,int4:g128/q8_0")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=fair.THREADS,
                    help=f"threads of every engine (default {fair.THREADS}: this machine's cores)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="write the rows (every run's seconds, threads) here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # kvwall and transformers share this process
    path = gguf_file(args.model)
    models = {f"kvwall {w}": load_model(path, weights=w) for w in args.weights.split(",")}
    hf = None if args.no_transformers else load_transformers(str(path))[0]
    llm = None if args.no_llama_cpp else load_llama_cpp(path, args.prompt + args.new + 8, args.threads)
    print(f"{path.name}; torch {torch.__version__}, {torch.get_num_threads()} threads; packed kernel built: "
          f"{packed_kernel() is not None}; llama.cpp: "
          f"{f'{llama_threads(llm)} threads' if llm else 'not installed'}")
    print("| engine | batch | decode tok/s | vs transformers | vs llama.cpp | weight bytes | tokens = transformers' "
          "| runs (s) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        new = bench_batch(models, hf, batch, args.prompt, args.new, args.runs, llm, args.threads)
        rows += new
        for r in new:
            ratio = f"{r['vs_transformers']:.2f}x" if r["vs_transformers"] else "-"
            cpp = f"{r['vs_llama_cpp']:.2f}x" if r["vs_llama_cpp"] else "-"
            size = f"{r['bytes'] / 1e6:.1f} MB" if r["bytes"] else "-"
            same = "-" if r["same_tokens"] is None else ("yes" if r["same_tokens"] else "no")
            runs = ", ".join(f"{t:.2f}" for t in r["runs_s"])
            print(f"| {r['engine']} | {batch} | {r['tok_s']:.1f} | {ratio} | {cpp} | {size} | {same} | {runs} |",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": str(path), "window": "each engine's own one-token decode step and argmax, `new` steps a run",
            "prompt": args.prompt, "new": args.new, "threads": args.threads, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
