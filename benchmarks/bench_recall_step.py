"""One training step of `kvwall recall`'s models: median seconds per step (forward, backward, AdamW).

    .venv/bin/python benchmarks/bench_recall_step.py [--archs attention,mamba,mamba2,hybrid] [--width 64]
        [--seqs 128,256] [--steps 3] [--threads 1]

The models, data (MQAR, 8 pairs, batch 32) and initialisation are kvwall.measure.recall's; the first step is a
warm-up (kernel builds, allocation) and is not counted. These numbers sized recall's defaults (recall_cmd.py).
"""

from __future__ import annotations

import argparse
import statistics
import time


def step_seconds(arch: str, width: int, seq: int, steps: int) -> float:
    import torch
    import torch.nn.functional as F

    from kvwall.measure import recall

    a = recall.parse_archs(arch, seq)[0]
    model = recall.build(recall.model_spec(a, width, seq), 0)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    times = []
    for s in range(steps + 1):
        tokens, targets = recall.mqar(32, seq, 8, seed=s)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=recall.IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default="attention,mamba,mamba2,hybrid")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seqs", default="128,256")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for seq in map(int, args.seqs.split(",")):
        for arch in args.archs.split(","):
            seconds = step_seconds(arch, args.width, seq, args.steps)
            print(f"{arch:10s} width {args.width} seq {seq}: {seconds:.3f} s a step", flush=True)


if __name__ == "__main__":
    main()
