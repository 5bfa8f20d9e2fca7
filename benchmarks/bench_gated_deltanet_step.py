"""The Gated DeltaNet decode step (engine/layers/gated_deltanet.py gated_delta_step) against the calibrated bandwidth.

    python benchmarks/bench_gated_deltanet_step.py [--layers 36] [--heads 32] [--dk 128] [--dv 128] [--batch 1]
                                                   [--runs 15] [--threads 1] [--out FILE.json]

A decode step of a Gated DeltaNet layer must read its state S (heads x dk x dv, fp32 here) and write it back: at
least 2 x S bytes. Qwen3-Next-80B-A3B's layer (config.json: 32 value heads, 16 key heads, dk = dv = 128) holds
32 x 128 x 128 x 4 B = 2 MiB per sequence, and 36 of its 48 layers are Gated DeltaNet: 72 MiB per step at batch 1,
more than any last-level cache here, so the step is timed over `--layers` distinct states in turn, as a model's
decode step meets them. Timed in turn, in one run: the C++ kernel (kernels/delta_rule.cpp through
gated_delta_decode_, the decode fast path), the torch in-place step (gated_delta_step_, its fallback), the reference
step (gated_delta_step, new tensors, then copied into the state as the layer's
reference path does), and one bare in-place pass over the same states (S *= c: the least a step can cost, as
this machine streams at this moment). Reported: the median seconds of each over --runs, the bytes that must
move (2 x state x layers x batch), each step's rate over the bare pass's (the fraction that holds on a
busy machine too) and over the calibrated streaming read (memory_bandwidth_Bps of
~/.cache/kvwall/local-device.json, `kvwall calibrate`; meaningful only on a quiet machine).
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
from kvwall.engine.layers.gated_deltanet import gated_delta_decode_, gated_delta_step, gated_delta_step_
from kvwall.files import home


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="one run per thread count")
    ap.add_argument("--out", help="also write the JSON to this file (benchmarks/results/delta_rule_step.json)")
    a = ap.parse_args()
    results = [run(a, threads) for threads in a.threads]
    print(json.dumps(results, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


def run(a, threads: int) -> dict:
    """One run at `threads` torch threads (the kernel's at::parallel_for uses as many)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    B, H = a.batch, a.heads
    states = [torch.randn(B, H, a.dk, a.dv, generator=g) * 0.1 for _ in range(a.layers)]  # (B, H, dk, dv) each
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, a.dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, a.dv, generator=g)  # (B, H, dv)
    decay, beta = -torch.rand(B, H, generator=g), torch.rand(B, H, generator=g)  # (B, H)

    if delta_rule("delta_step") is None:
        raise SystemExit("the C++ kernel delta_rule did not build (see the warning above): nothing to compare")

    def kernel() -> None:
        for S in states:
            gated_delta_decode_(q, k, v, decay, beta, S)

    def fast() -> None:
        for S in states:
            gated_delta_step_(q, k, v, decay, beta, S)

    def reference() -> None:
        for S in states:
            _, new = gated_delta_step(q, k, v, decay, beta, S)
            S.copy_(new)  # the cache's storage, written back as the layer does

    def bare() -> None:
        for S in states:
            S.mul_(0.999)  # one read and one write of the state

    times: dict[str, list[float]] = {"kernel": [], "fast": [], "reference": [], "bare": []}
    for _ in range(a.runs):
        for name, fn in (("kernel", kernel), ("fast", fast), ("reference", reference), ("bare", bare)):  # same load
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    t = {name: statistics.median(ts) for name, ts in times.items()}
    moved = 2 * states[0].nbytes * a.layers * 1  # read + write of every state, once (B is in nbytes)
    out = {"kernel_step_s": t["kernel"], "fast_step_s": t["fast"], "reference_step_s": t["reference"],
           "bare_pass_s": t["bare"], "bytes_moved": moved, "kernel_rate_Bps": moved / t["kernel"],
           "fast_rate_Bps": moved / t["fast"], "bare_rate_Bps": moved / t["bare"],
           "kernel_fraction_of_bare_pass": t["bare"] / t["kernel"], "fraction_of_bare_pass": t["bare"] / t["fast"],
           "kernel_speedup_over_torch": t["fast"] / t["kernel"], "layers": a.layers, "heads": H, "dk": a.dk,
           "dv": a.dv, "batch": B, "runs": a.runs, "state_bytes_per_layer": states[0].nbytes, "threads": threads,
           "torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg()),
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python benchmarks/bench_gated_deltanet_step.py " + " ".join(sys.argv[1:])}
    try:
        cal = json.loads((home() / "local-device.json").read_text())["memory_bandwidth_Bps"]
        out |= {"calibrated_read_Bps": cal, "kernel_fraction_of_calibrated": moved / t["kernel"] / cal,
                "fraction_of_calibrated": moved / t["fast"] / cal}
    except (OSError, KeyError, ValueError):
        out["calibrated_read_Bps"] = None  # no `kvwall calibrate` profile here
    return out


if __name__ == "__main__":
    main()
