"""Prefill at long prompts (issue #43): TTFT of SmolLM2-135M on its own Q4_1 GGUF, kvwall on the file's native
weights (PackedLinear) with the packed matmul's GEMM path (packed.h: the weight dequantized once per call to
float32, then torch's GEMM) and with the row kernel it replaced (layers/packed.py GEMM_ROWS = 0), against llama.cpp
on the same file (f16 KV, flash attention on).

    python benchmarks/bench_prefill.py [--contexts 2048,4096] [--runs 3] [--threads 2]
        [--json benchmarks/results/prefill_t2.json] [--crossover] [--rows 1,4,16,32,64,256,4096]

TTFT: a fresh engine prefills one random prompt of that many tokens (fixed seed) and picks the first token (the
last position's logits only, both engines); engines take turns run by run, the order reversed every other
round (benchmarks/fair.py), median of --runs; every engine on --threads threads (torch.set_num_threads;
llama.cpp's n_threads and n_threads_batch, n_batch 512 as bench_long_race.py), each row recording the count
given and the count the engine reports.

--crossover first times one PackedLinear call (int4, groups of 32, fp16 scale and zero: Q4_1's layout) at
SmolLM2's matrix shapes with --rows rows of x, row kernel against GEMM path (the fastest of 15 after 2 warm-ups): where
the GEMM path starts to win is packed.h's GEMM_MIN_ROWS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvwall.engine.layers import packed
from kvwall.engine.layers.packed import PackedLinear, gemm_min_rows, packed_kernel
from kvwall.engine.load import load_model
from kvwall.measure.real_worker import KvwallEngine
from kvwall.spec.formats import get_format
from kvwall.spec.gguf_meta import gguf_file

sys.path.insert(0, str(Path(__file__).parent))
from bench_long_race import load_llama
from bench_real_decode import LlamaCppEngine, llama_threads

import fair  # benchmarks/fair.py: the same threads for every engine, runs in turns

# SmolLM2-135M's projections (N out, K in): attention's fused q/k/v (9 + 3 + 3 heads of 64), o, the MLP's fused
# gate and up (2 x 1536), down
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROW_KERNEL, GEMM_PATH = 0, -1  # packed.GEMM_ROWS: never the GEMM path; from the kernel's own GEMM_MIN_ROWS


def fastest_us(call, runs: int = 15, warmup: int = 2) -> float:
    """The fastest of `runs` timed calls, in microseconds: on a shared machine a call's median can be one scheduler
    time slice (28 ms here: a thread of the pair descheduled), the fastest is what the kernel itself costs."""
    times = []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        call()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return min(times) * 1e6


def crossover(rows: list[int]) -> list[dict]:
    """Microseconds of one call per shape and rows of x, row kernel and GEMM path (from 1 row on)."""
    kernel = packed_kernel()
    fmt = get_format("int4:g32")  # asymmetric: fp16 scale and zero per 32, Q4_1's layout
    out = []
    for name, (N, K) in SHAPES.items():
        lin = PackedLinear.from_linear(torch.nn.Linear(K, N, bias=False), fmt)
        args = (lin.q, lin.scale, lin.zero, lin.bits, lin.group)
        for m in rows:
            x = torch.randn(m, K)  # (M, K)
            t = {how: fastest_us(lambda g=g, x=x, a=args: kernel(x, *a, g)) for how, g in (("rows", 0), ("gemm", 1))}
            out.append({"matrix": name, "N": N, "K": K, "M": m, "row_kernel_us": t["rows"], "gemm_us": t["gemm"],
                        "gemm_speedup": t["rows"] / t["gemm"]})
            print(f"| {name} {N}x{K} | {m} | {t['rows']:.0f} | {t['gemm']:.0f} | {t['rows'] / t['gemm']:.2f}x |",
                  flush=True)
    return out


class Switched(KvwallEngine):
    """kvwall's engine with packed.GEMM_ROWS set to `gemm_rows` for its prefill."""

    def __init__(self, gemm_rows: int, *args):
        packed.GEMM_ROWS = gemm_rows
        try:
            super().__init__(*args)
        finally:
            packed.GEMM_ROWS = GEMM_PATH


@torch.inference_mode()
def race(model, llm, context: int, runs: int, threads: int) -> list[dict]:
    prompt = torch.randint(0, model.spec.vocab, (1, context), generator=torch.Generator().manual_seed(context))
    makers = {"kvwall native, GEMM path": lambda: Switched(GEMM_PATH, model, "contiguous", prompt, context + 1,
                                                           "native"),
              "kvwall native, row kernel (before)": lambda: Switched(ROW_KERNEL, model, "contiguous", prompt,
                                                                     context + 1, "native")}
    if llm is not None:
        makers["llama.cpp, f16 KV, flash attn"] = lambda: LlamaCppEngine(llm, prompt)
    ttft: dict[str, list[float]] = {k: [] for k in makers}
    first: dict[str, int] = {}
    for _, name in fair.turns(list(makers), runs):
        t0 = time.perf_counter()
        e = makers[name]()
        ttft[name].append(time.perf_counter() - t0)
        first[name] = int(e.tokens[0].flatten()[0])
    rows = []
    for name in makers:
        cpp = name.startswith("llama.cpp")
        rows.append({"engine": name, "context": context, "ttft_s": statistics.median(ttft[name]),
                     "runs_s": ttft[name], "first_token": first[name], "threads": threads,
                     "threads_reported": llama_threads(llm) if cpp else torch.get_num_threads(),
                     "threads_reported_by": "llama.cpp context n_threads" if cpp else "torch.get_num_threads()"})
    cpp = next((r["ttft_s"] for r in rows if r["engine"].startswith("llama.cpp")), None)
    for r in rows:
        r["vs_llama_cpp"] = r["ttft_s"] / cpp if cpp else None  # below 1: sooner than llama.cpp
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=fair.THREADS)
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--rows", default="1,4,8,16,24,32,48,64,256,4096")
    ap.add_argument("--no-llama", action="store_true", help="kvwall's two paths only")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. what else ran on the machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if packed_kernel() is None:
        sys.exit("the packed_linear C++ kernel did not build: nothing to compare")
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GEMM_MIN_ROWS {gemm_min_rows()}; "
          f"load average {load:.2f}")
    cross = []
    if args.crossover:
        print("| matrix | rows | row kernel (us) | GEMM path (us) | speedup |\n|---|---|---|---|---|")
        cross = crossover([int(r) for r in args.rows.split(",")])
    path = gguf_file(args.model)
    model = load_model(path, weights="native")
    print(f"{path.name}\n| engine | context | TTFT (s) | vs llama.cpp | runs (s) |\n|---|---|---|---|---|")
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        llm = None if args.no_llama else load_llama(path, ctx + 8, args.threads, "f16")
        for r in race(model, llm, ctx, args.runs, args.threads):
            rows.append(r)
            vs = f"{r['vs_llama_cpp']:.2f}x" if r["vs_llama_cpp"] else "-"
            runs = ", ".join(f"{t:.2f}" for t in r["runs_s"])
            print(f"| {r['engine']} | {ctx} | {r['ttft_s']:.2f} | {vs} | {runs} |", flush=True)
        del llm
        if args.json:  # after each context: a long run cut short keeps what it measured
            write(args, path, load, cross, rows)


def write(args, path: Path, load: float, cross: list[dict], rows: list[dict]) -> None:
    Path(args.json).write_text(json.dumps({
        "model": str(path), "weights": "kvwall: the file's Q4_1 blocks, repacked at load (native); llama.cpp: "
        "the file", "window": "TTFT: a fresh engine's prefill of the prompt and its first token's argmax",
        "threads": args.threads, "torch": torch.__version__, "gemm_min_rows": gemm_min_rows(),
        "load_average_at_start": load, "load_average_at_end": os.getloadavg()[0], "note": args.note,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "crossover": cross, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
