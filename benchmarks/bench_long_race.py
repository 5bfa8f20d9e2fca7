"""The long-context race (issue #43): SmolLM2-135M on its own Q4_1 GGUF at batch 1, with 2k-8k tokens of context:
kvwall on the file's native weights with each cache (exact, fp8, int8, int4) against llama.cpp on the same file
with each KV type (f16, q8_0, q4_0; flash attention on, which quantized V needs).

    python benchmarks/bench_long_race.py [--contexts 2048,4096,8192] [--new 32] [--runs 3] [--threads 2]
        [--caches contiguous,fp8,int8,int4] [--kv f16,q8_0,q4_0] [--json benchmarks/results/long_race_t2.json]

Per context: one random prompt of that many tokens (fixed seed). Each engine prefills it (timed: TTFT), then
`new` greedy decode steps are timed as one run (its own one-token step and argmax). Engines take turns run by run,
the order reversed every other round (benchmarks/fair.py), median of --runs; every engine on --threads threads
(torch.set_num_threads; llama.cpp's n_threads and n_threads_batch), each row recording the count given and the
count the engine reports. Prints a markdown table; --json writes every run's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvwall.engine.load import load_model
from kvwall.measure.real_worker import KvwallEngine
from kvwall.spec.gguf_meta import gguf_file

sys.path.insert(0, str(Path(__file__).parent))
from bench_real_decode import LlamaCppEngine, llama_threads

import fair  # benchmarks/fair.py: the same threads for every engine, runs in turns

KV_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type numbers (ggml.h: GGML_TYPE_F16 1, Q4_0 2, Q8_0 8)


def load_llama(path: Path, n_ctx: int, threads: int, kv: str):
    from llama_cpp import Llama

    t = KV_TYPES[kv]
    return Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, flash_attn=True,
                 type_k=t, type_v=t, verbose=False)


def timed(make, new: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for `new` tokens) of a fresh engine from make()."""
    t0 = time.perf_counter()
    e = make()
    t1 = time.perf_counter()
    for _ in range(new):
        e.step()
    return t1 - t0, time.perf_counter() - t1


@torch.inference_mode()
def race(model, llms: dict, context: int, new: int, runs: int, caches: list[str], threads: int) -> list[dict]:
    prompt = torch.randint(0, 49152, (1, context), generator=torch.Generator().manual_seed(context))  # (1, T)
    makers = {f"kvwall native, {c} cache": (lambda c=c: KvwallEngine(model, c, prompt, context + new + 1, "native"))
              for c in caches}
    makers |= {f"llama.cpp, {kv} KV, flash attn": (lambda llm=llm: LlamaCppEngine(llm, prompt))
               for kv, llm in llms.items()}
    pre: dict[str, list[float]] = {k: [] for k in makers}
    dec: dict[str, list[float]] = {k: [] for k in makers}
    for _, name in fair.turns(list(makers), runs):
        p, d = timed(makers[name], new)
        pre[name].append(p)
        dec[name].append(d)
    rows = []
    for name in makers:
        cpp = name.startswith("llama.cpp")
        llm = llms[name.split(", ")[1].split()[0]] if cpp else None
        rows.append({"engine": name, "context": context, "batch": 1, "new": new,
                     "decode_tok_s": new / statistics.median(dec[name]), "ttft_s": statistics.median(pre[name]),
                     "decode_runs_s": dec[name], "prefill_runs_s": pre[name], "threads": threads,
                     "threads_reported": llama_threads(llm) if cpp else torch.get_num_threads(),
                     "threads_reported_by": "llama.cpp context n_threads" if cpp else "torch.get_num_threads()"})
    best_cpp = max(r["decode_tok_s"] for r in rows if r["engine"].startswith("llama.cpp")) if llms else None
    for r in rows:
        r["vs_best_llama_cpp"] = r["decode_tok_s"] / best_cpp if best_cpp else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=fair.THREADS)
    ap.add_argument("--caches", default="contiguous,fp8,int8,int4")
    ap.add_argument("--kv", default="f16,q8_0,q4_0")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = gguf_file(args.model)
    model = load_model(path, weights="native")
    contexts = [int(c) for c in args.contexts.split(",")]
    kvs = [k for k in args.kv.split(",") if k]
    print(f"{path.name}; torch {torch.__version__}, {torch.get_num_threads()} threads; llama.cpp KV {kvs}")
    print("| engine | context | decode tok/s | vs best llama.cpp | TTFT (s) | decode runs (s) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for ctx in contexts:
        llms = {kv: load_llama(path, ctx + args.new + 8, args.threads, kv) for kv in kvs}
        for r in race(model, llms, ctx, args.new, args.runs, args.caches.split(","), args.threads):
            rows.append(r)
            vs = f"{r['vs_best_llama_cpp']:.2f}x" if r["vs_best_llama_cpp"] else "-"
            runs = ", ".join(f"{t:.2f}" for t in r["decode_runs_s"])
            print(f"| {r['engine']} | {ctx} | {r['decode_tok_s']:.1f} | {vs} | {r['ttft_s']:.1f} | {runs} |",
                  flush=True)
        del llms
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": str(path), "weights": "kvwall: the file's Q4_1 blocks, repacked at load (native); llama.cpp: "
            "the file", "window": "prefill timed as TTFT; then `new` one-token decode steps and argmax, one run",
            "new": args.new, "threads": args.threads, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
