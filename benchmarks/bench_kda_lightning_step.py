"""The Kimi Delta Attention and lightning-attention decode steps (engine/layers/kda.py, lightning.py) against one bare
in-place pass over the same states.

    python benchmarks/bench_kda_lightning_step.py [--runs 15] [--threads 1 [2 ...]] [--out FILE.json]

A decode step must read each layer's state and write it back: at least 2 x state bytes. Kimi-Linear-48B-A3B
(catalog/models/kimi-linear-48b-a3b.json): 20 KDA layers of 32 heads x 128 x 128 (2 MiB each in fp32);
MiniMax-Text-01 (catalog/models/minimax-text-01.json): 70 lightning layers of 64 heads x 128 x 128 (4 MiB each).
Distinct states per layer (40 and 280 MiB: more than a last-level cache), stepped in turn as a decode step meets
them. Timed in turn, in one run (interleaved, so each sees the same load): the C++ kernel (kernels/delta_rule.cpp
through gated_delta_decode_ / lightning_decode_, the decode fast path), the torch in-place step it falls back to
(gated_delta_step_ with a decay per key channel / lightning_step_) and one bare pass (S *= 1). Reported per model
and thread count: the median seconds of each, and each step's rate as a fraction of the bare pass's (a fraction
that holds on a busy machine too).
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

from kvwall.engine.layers.delta_kernel import delta_rule
from kvwall.engine.layers.gated_deltanet import gated_delta_decode_, gated_delta_step_
from kvwall.engine.layers.lightning import lightning_decode_, lightning_step_

MODELS = {"kimi_linear (20 KDA layers, 32 x 128 x 128)": ("kda", 20, 32, 128),
          "minimax (70 lightning layers, 64 x 128 x 128)": ("lightning", 70, 64, 128)}


def time_model(kind: str, layers: int, H: int, d: int, runs: int, g) -> tuple[dict[str, float], int]:
    """({kernel, torch, bare: median s over every layer}, bytes read + written) for distinct states."""
    states = [torch.randn(1, H, d, d, generator=g) * 0.1 for _ in range(layers)]  # (B, H, d, d) per layer
    q, k = (torch.nn.functional.normalize(torch.randn(1, H, d, generator=g), dim=-1) for _ in range(2))  # (B, H, d)
    v = torch.randn(1, H, d, generator=g)  # (B, H, d)
    decay = -torch.rand(1, H, d, generator=g)  # (B, H, d): KDA's per-channel log decay (lightning: its first)
    beta = torch.rand(1, H, generator=g)  # (B, H)
    kda = kind == "kda"

    def kernel():
        for S in states:
            gated_delta_decode_(q, k, v, decay, beta, S) if kda else lightning_decode_(q, k, v, decay[..., 0], S)

    def torch_step():
        for S in states:
            gated_delta_step_(q, k, v, decay, beta, S) if kda else lightning_step_(q, k, v, decay[..., 0], S)

    def bare():
        for S in states:
            S.mul_(1.0)

    times: dict[str, list[float]] = {"kernel": [], "torch": [], "bare": []}
    for _ in range(runs):
        for name, fn in (("kernel", kernel), ("torch", torch_step), ("bare", bare)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}, 2 * sum(S.nbytes for S in states)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="one run per thread count")
    ap.add_argument("--out", help="also write the results as JSON (benchmarks/results/kda_lightning_step.json)")
    args = ap.parse_args()
    if delta_rule("delta_step") is None:
        raise SystemExit("the C++ kernel delta_rule did not build (see the warning above): nothing to compare")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(0)
        for name, (kind, layers, H, d) in MODELS.items():
            t, moved = time_model(kind, layers, H, d, args.runs, g)
            rows.append({"model": name, "threads": threads, "kernel_step_s": t["kernel"], "torch_step_s": t["torch"],
                         "bare_pass_s": t["bare"], "bytes_moved": moved,
                         "kernel_fraction_of_bare_pass": t["bare"] / t["kernel"],
                         "torch_fraction_of_bare_pass": t["bare"] / t["torch"],
                         "load_average": list(os.getloadavg())})
            print(f"{name}, {threads} thread(s): {moved / 2**20:.0f} MiB read + written; kernel {t['kernel'] * 1e3:.1f}"
                  f" ms ({moved / t['kernel'] / 1e9:.2f} GB/s), torch {t['torch'] * 1e3:.1f} ms, bare pass "
                  f"{t['bare'] * 1e3:.1f} ms ({moved / t['bare'] / 1e9:.2f} GB/s): kernel at "
                  f"{t['bare'] / t['kernel']:.2f} of the bare pass's rate, torch at {t['bare'] / t['torch']:.2f}")
    if args.out:
        meta = {"runs": args.runs, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "command": "python benchmarks/bench_kda_lightning_step.py " + " ".join(sys.argv[1:])}
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
