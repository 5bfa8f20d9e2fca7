"""The Kimi Delta Attention and lightning-attention decode steps (engine/layers/kda.py kda_step_, lightning.py
lightning_step_) against one bare in-place pass over the same states.

    python benchmarks/bench_kda_lightning_step.py [--runs 15] [--threads 1]

A decode step must read each layer's state and write it back: at least 2 x state bytes. Kimi-Linear-48B-A3B
(catalog/models/kimi-linear-48b-a3b.json): 20 KDA layers of 32 heads x 128 x 128 (2 MiB each in fp32);
MiniMax-Text-01 (catalog/models/minimax-text-01.json): 70 lightning layers of 64 heads x 128 x 128 (4 MiB each).
Distinct states per layer (40 and 280 MiB: more than a last-level cache), stepped in turn as a decode step meets
them. Reported per model: the median seconds of the step over all layers and of one bare pass (S *= 1), and the
step's rate as a fraction of the bare pass's (a fraction that holds on a busy machine too).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvwall.engine.layers.kda import kda_step_
from kvwall.engine.layers.lightning import lightning_step_

MODELS = {"kimi_linear (20 KDA layers, 32 x 128 x 128)": ("kda", 20, 32, 128),
          "minimax (70 lightning layers, 64 x 128 x 128)": ("lightning", 70, 64, 128)}


def median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_model(kind: str, layers: int, H: int, d: int, runs: int, g) -> tuple[float, float, int]:
    """(median s of the step over every layer, of one bare pass, bytes read + written) for distinct states."""
    states = [torch.randn(1, H, d, d, generator=g) for _ in range(layers)]  # (B, H, d, d) per layer
    q, k, v = (torch.randn(1, H, d, generator=g) for _ in range(3))  # (B, H, d)
    decay = -torch.rand(1, H, d, generator=g)  # (B, H, d): KDA's per-channel log decay
    beta = torch.rand(1, H, generator=g)  # (B, H)

    def step():
        for S in states:
            kda_step_(q, k, v, decay, beta, S) if kind == "kda" else lightning_step_(q, k, v, decay[..., 0], S)

    def bare():
        for S in states:
            S.mul_(1.0)

    return median_seconds(step, runs), median_seconds(bare, runs), 2 * sum(S.nbytes for S in states)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for name, (kind, layers, H, d) in MODELS.items():
        t_step, t_bare, moved = time_model(kind, layers, H, d, args.runs, g)
        print(f"{name}: {moved / 2**20:.0f} MiB read + written; step {t_step * 1e3:.1f} ms "
              f"({moved / t_step / 1e9:.2f} GB/s), bare pass {t_bare * 1e3:.1f} ms ({moved / t_bare / 1e9:.2f} GB/s): "
              f"the step at {t_bare / t_step:.2f} of the bare pass's rate")


if __name__ == "__main__":
    main()
