"""The memory wall, served: throughput and time per output token against the KV pool's size, per pool format.

    .venv/bin/python benchmarks/bench_serve_memory_wall.py [--model smollm2-135m] [--requests 32]
        [--prompt 128] [--output 64] [--blocks 8,16,32,64,128] [--formats fp32,bf16,fp8,int8,int4] [--max-batch 32]

Offline (no HTTP): every request arrives at once and the runner (kvwall.serve.runner) steps until all
finished; a step's wall time is charged to each token it produced. Per pool size and format it prints
output tokens/s, p50/p99 time per output token (the step times the decoding requests saw), the largest
batch that ran, and the preemptions. The pool is given in fp32 blocks (--blocks); a smaller format
gets the same bytes, so more blocks: fp8 holds four times the tokens of fp32, and its preemptions stop
at a quarter of the memory. Timings belong on a quiet machine; the numbers move with load.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvwall.engine.load import load_model
from kvwall.serve.runner import Runner, block_bytes
from kvwall.serve.scheduler import Request


def model_path(name: str):
    from kvwall.spec.gguf_meta import gguf_file

    return gguf_file(name) or name


def run(model, kv_memory: int, fmt: str, args) -> dict:
    runner = Runner(model, kv_memory=kv_memory, block_size=16, chunk=args.chunk, max_batch=args.max_batch,
                    kv_dtype=fmt)
    g = torch.Generator().manual_seed(0)
    for i in range(args.requests):
        prompt = torch.randint(0, model.spec.vocab, (args.prompt,), generator=g).tolist()
        runner.add(Request(i, prompt, args.output))  # no stop tokens: every request runs to --output
    per_token, widest, t0 = [], 0, time.perf_counter()
    while runner.sched.has_work():
        s0 = time.perf_counter()
        step, _ = runner.step()
        dt = time.perf_counter() - s0
        per_token += [dt] * len(step.sampled)
        widest = max(widest, len(step.chunks))
    wall = time.perf_counter() - t0
    return {"format": fmt, "blocks": runner.sched.pool.n_blocks, "tok_s": runner.generated / wall,
            "tpot_p50_ms": float(np.percentile(per_token, 50) * 1e3),
            "tpot_p99_ms": float(np.percentile(per_token, 99) * 1e3), "widest": widest,
            "preemptions": runner.sched.preemptions}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--blocks", default="8,16,32,64,128", help="pool sizes in fp32 blocks of 16 tokens")
    p.add_argument("--formats", default="fp32,bf16,fp8,int8,int4", help="pool formats (serve --cache names)")
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(model_path(args.model))
    fp32_block = block_bytes(model.spec, 16, torch.float32)
    need = -(-(args.prompt + args.output) // 16)
    print(f"{args.model}: {fp32_block} B per fp32 block of 16 tokens; one request needs {need} blocks, "
          f"all {args.requests} need {need * args.requests}")
    print(f"{'fp32 blocks':>11} {'format':>6} {'blocks':>6} {'tok/s':>8} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'batch':>5} {'preempt':>7}")
    for n in [int(x) for x in args.blocks.split(",")]:
        for fmt in args.formats.split(","):
            if n < need:
                continue  # one request would not fit: the server refuses it
            r = run(model, n * fp32_block, fmt, args)
            print(f"{n:>11} {fmt:>6} {r['blocks']:>6} {r['tok_s']:>8.1f} {r['tpot_p50_ms']:>8.1f}m "
                  f"{r['tpot_p99_ms']:>8.1f}m {r['widest']:>5} {r['preemptions']:>7}")


if __name__ == "__main__":
    main()
