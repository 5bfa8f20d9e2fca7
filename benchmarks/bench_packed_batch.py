"""One decode step's packed matmuls at batch M: every PackedLinear of a GGUF model on its native weights (the
head included) called once, in the model's order, with M rows of x, as a batched decode step calls them; printed as
ms a step, the G multiply-adds/s and the GB/s of weight bytes that makes. With --src, the same in each of several
checkouts of kvwall (their kernels build apart: packed.h before and after a change), run in turns. With
--activations int8 each matrix rounds x to int8 first (--weights native+a8), called through PackedLinear.forward.

    python benchmarks/bench_packed_batch.py [--model gemma-3-270m] [--batches 1,2,4,8] [--runs 5] [--threads 2]
        [--activations fp32,int8] [--src before=/tmp/old/src --src after=src]
        [--json benchmarks/results/packed_batch_t2.json]

Each run is a fresh process (PYTHONPATH = that checkout's src, OMP_NUM_THREADS = --threads) that loads the model,
warms each batch up with 2 steps and reports the median of 7 timed steps per batch; the checkouts take turns run by
run, the order reversed every other round (benchmarks/fair.py), and each figure is the median of --runs runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import fair  # benchmarks/fair.py: the same threads for every build, runs in turns


def worker(model: str, batches: list[int], activations: str = "fp32") -> dict:
    """{M: seconds of one step's packed matmuls}, with the step's weight bytes and multiply-adds per row of x."""
    import torch

    from kvwall.engine.layers.packed import PackedLinear, packed_kernel
    from kvwall.engine.load import load_model
    from kvwall.spec.gguf_meta import gguf_file

    m = load_model(str(gguf_file(model)), weights="native")
    mats = [mod for mod in m.modules() if isinstance(mod, PackedLinear)]
    kernel = packed_kernel()
    if activations == "int8":
        for p in mats:
            p.x8 = True
    out = {"threads": torch.get_num_threads(), "matrices": len(mats),
           "weight_bytes": sum(p.weight_bytes() for p in mats),
           "macs_per_row": sum(p.in_features * p.out_features for p in mats), "step_s": {}}
    with torch.inference_mode():
        for b in batches:
            xs = [torch.randn(b, p.in_features) for p in mats]  # (M, K) each

            def step(xs=xs):
                for p, x in zip(mats, xs):
                    if activations == "int8":
                        p(x)  # (M, N): rounded x, the integer kernel where the CPU has VNNI
                    else:
                        kernel(x, p.q, p.scale, p.zero, p.bits, p.group, -1)  # (M, N)

            times = []
            for i in range(9):
                t0 = time.perf_counter()
                step()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            out["step_s"][str(b)] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=fair.THREADS)
    ap.add_argument("--src", action="append", metavar="LABEL=PATH",
                    help="a checkout's src folder to import kvwall from (repeat; default: this one)")
    ap.add_argument("--activations", default="fp32", help="fp32 (exact), int8 (+a8), or both: fp32,int8")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        print(json.dumps(worker(args.model, batches, args.activations)))
        return
    here = Path(__file__).resolve().parent
    srcs = dict(s.split("=", 1) for s in (args.src or [f"this={here.parent / 'src'}"]))
    # one contestant per checkout and activations: "label" alone with one mode, "label/int8" with several
    modes = args.activations.split(",")
    entries = {(f"{k}/{a}" if len(modes) > 1 else k): (k, a) for k in srcs for a in modes}
    runs: dict[str, list[dict]] = {k: [] for k in entries}
    for i, (run, label) in enumerate(fair.turns(list(entries), args.runs)):
        src, mode = entries[label]
        env = {**os.environ, **fair.torch_env(args.threads), "PYTHONPATH": str(Path(srcs[src]).resolve())}
        res = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model, "--batches", args.batches,
                              "--activations", mode], env=env, capture_output=True, text=True, check=True, cwd=here)
        runs[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
        steps = ", ".join(f"M={b} {1e3 * runs[label][-1]['step_s'][str(b)]:.1f} ms" for b in batches)
        print(f"[{i + 1}/{len(entries) * args.runs}] run {run}, {label}: {steps}", file=sys.stderr, flush=True)
    rows = []
    for label, rs in runs.items():
        for b in batches:
            s = statistics.median(r["step_s"][str(b)] for r in rs)
            src, mode = entries[label]
            rows.append({"src": label, "path": srcs[src], "activations": mode, "batch": b, "step_ms": 1e3 * s,
                         "runs_ms": [1e3 * r["step_s"][str(b)] for r in rs], "threads": args.threads,
                         "threads_reported": rs[0]["threads"], "gmac_s": b * rs[0]["macs_per_row"] / s / 1e9,
                         "weight_gb_s": rs[0]["weight_bytes"] / s / 1e9})
            r = rows[-1]
            print(f"{label:>10}  M={b:<3} {r['step_ms']:7.1f} ms a step  {r['gmac_s']:6.1f} G multiply-adds/s  "
                  f"{r['weight_gb_s']:5.1f} GB/s of weights  (runs {', '.join(f'{t:.1f}' for t in r['runs_ms'])})")
    if args.json:
        from kvwall.measure.machine import cpu_facts

        doc = {"model": args.model, "matrices": runs[next(iter(runs))][0]["matrices"], "runs": args.runs,
               "threads": args.threads, "cpu": cpu_facts(), "rows": rows,
               "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
