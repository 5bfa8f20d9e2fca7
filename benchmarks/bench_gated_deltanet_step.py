"""The Gated DeltaNet decode step (engine/layers/gated_deltanet.py gated_delta_step) against the calibrated bandwidth.

    python benchmarks/bench_gated_deltanet_step.py [--layers 36] [--heads 32] [--dk 128] [--dv 128] [--batch 1]
                                                   [--runs 15] [--threads 1]

A decode step of a Gated DeltaNet layer must read its state S (heads x dk x dv, fp32 here) and write it back: at
least 2 x S bytes. Qwen3-Next-80B-A3B's layer (config.json: 32 value heads, 16 key heads, dk = dv = 128) holds
32 x 128 x 128 x 4 B = 2 MiB per sequence, and 36 of its 48 layers are Gated DeltaNet: 72 MiB per step at batch 1,
more than any last-level cache here, so the step is timed over `--layers` distinct states in turn, as a model's
decode step meets them. Timed in turn, in one run: the engine's in-place step (gated_delta_step_, the decode
fast path), the reference step (gated_delta_step, new tensors, then copied into the state as the layer's
reference path does), and one bare in-place pass over the same states (S *= c: the least a step can cost, as
this machine streams at this moment). Reported: the median seconds of each over --runs, the bytes that must
move (2 x state x layers x batch), the fast step's rate over the bare pass's (the fraction that holds on a
busy machine too) and over the calibrated streaming read (memory_bandwidth_Bps of
~/.cache/kvwall/local-device.json, `kvwall calibrate`; meaningful only on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvwall.engine.layers.gated_deltanet import gated_delta_step, gated_delta_step_
from kvwall.files import home


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    B, H = a.batch, a.heads
    states = [torch.randn(B, H, a.dk, a.dv, generator=g) * 0.1 for _ in range(a.layers)]  # (B, H, dk, dv) each
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, a.dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, a.dv, generator=g)  # (B, H, dv)
    decay, beta = -torch.rand(B, H, generator=g), torch.rand(B, H, generator=g)  # (B, H)

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

    times: dict[str, list[float]] = {"fast": [], "reference": [], "bare": []}
    for _ in range(a.runs):
        for name, fn in (("fast", fast), ("reference", reference), ("bare", bare)):  # interleaved: same load
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    t = {name: statistics.median(ts) for name, ts in times.items()}
    moved = 2 * states[0].nbytes * a.layers * 1  # read + write of every state, once (B is in nbytes)
    out = {"fast_step_s": t["fast"], "reference_step_s": t["reference"], "bare_pass_s": t["bare"],
           "bytes_moved": moved, "fast_rate_Bps": moved / t["fast"], "bare_rate_Bps": moved / t["bare"],
           "fraction_of_bare_pass": t["bare"] / t["fast"], "layers": a.layers,
           "state_bytes_per_layer": states[0].nbytes, "threads": a.threads}
    try:
        cal = json.loads((home() / "local-device.json").read_text())["memory_bandwidth_Bps"]
        out |= {"calibrated_read_Bps": cal, "fraction_of_calibrated": moved / t["fast"] / cal}
    except (OSError, KeyError, ValueError):
        out["calibrated_read_Bps"] = None  # no `kvwall calibrate` profile here
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
