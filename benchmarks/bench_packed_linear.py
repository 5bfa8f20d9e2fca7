"""One projection at SmolLM2-135M's shapes: y = x W^T with W in fp32 (F.linear, column-major as the engine
stores it; and oneDNN's prepacked layout, which the engine does not use yet), torch's packed CPU ops
(_weight_int8pack_mm, per-channel int8; _weight_int4pack_mm_for_cpu, int4 groups of 32) and kvwall's PackedLinear
kernel (int8 / int4, fp16 scales and zeros per group).

    .venv/bin/python benchmarks/bench_packed_linear.py [--runs 15] [--rows 1,16]

Every matrix is read cold, as in a decode step of a model larger than the cache: each call multiplies by the next
of enough copies of the weights (together at least 2 x the last-level cache and 256 MiB). Prints microseconds per
call (median of --runs) and the GB/s of weight bytes that makes.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from kvwall.engine.layers.packed import PackedLinear, packed_kernel
from kvwall.engine.model import column_major
from kvwall.measure.machine import llc_bytes
from kvwall.spec.formats import get_format

from timing import median_ms

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152)]  # (in K, out N): o_proj, up, down, lm_head


def copies(nbytes: int) -> int:
    return max(2, -(-2 * max(llc_bytes(), 256 << 20) // nbytes))


def cycler(make, nbytes: int):
    """A function returning the next of enough copies made by make()."""
    return itertools.cycle([make() for _ in range(copies(nbytes))]).__next__


def candidates(w: torch.Tensor) -> dict[str, tuple]:
    """name -> (bytes, make() -> step(x) -> y)."""
    N, K = w.shape
    out = {"fp32 F.linear": (w.numel() * 4, lambda: (lambda x, c=column_major(w.clone()): F.linear(x, c)))}
    if torch.backends.mkldnn.is_available():  # oneDNN's own blocked layout, packed once (what vLLM's CPU build uses)
        out["fp32 oneDNN prepacked"] = (w.numel() * 4, lambda: (
            lambda x, p=torch.ops.mkldnn._reorder_linear_weight(w.clone()):
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")))
    scales = w.abs().amax(1) / 127  # (N,)
    w8 = (w / scales[:, None]).round().to(torch.int8)
    out["torch int8pack (per row)"] = (w8.numel() + N * 4, lambda: (
        lambda x, b=w8.clone(), s=scales.clone(): torch.ops.aten._weight_int8pack_mm(x, b, s)))
    try:
        w4 = torch.randint(0, 16, (N, K), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4, 1)
        sz = torch.rand(K // 32, N, 2, dtype=torch.bfloat16)
        out["torch int4pack g32 (bf16 x)"] = (packed.numel() + sz.numel() * 2, lambda: (
            lambda x, b=packed.clone(): torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), b, 32, sz)))
    except (RuntimeError, AttributeError) as e:
        print(f"torch int4pack unusable: {str(e).splitlines()[0]}")
    lin = torch.nn.Linear(K, N, bias=False)
    lin.weight.data = w
    for f in ("int8", "int8:sym", "int4", "int4:g128"):
        p = PackedLinear.from_linear(lin, get_format(f))
        out[f"kvwall {f}"] = (p.weight_bytes(), lambda p=p: (lambda x, c=PackedLinear(
            p.q.clone(), p.scale.clone(), None if p.zero is None else p.zero.clone(), p.fmt, K): c(x)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"kernel built: {packed_kernel() is not None}; torch threads {torch.get_num_threads()}")
    print("| K x N | rows | path | us/call | GB/s of weights |\n|---|---|---|---|---|")
    for K, N in SHAPES:
        w = torch.randn(N, K) * 0.02
        for name, (nbytes, make) in candidates(w).items():
            nxt = cycler(make, nbytes)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, K)
                try:
                    ms = median_ms(lambda nxt=nxt, x=x: nxt()(x), args.runs)
                except RuntimeError as e:
                    print(f"| {K}x{N} | {rows} | {name} | failed: {str(e).splitlines()[0][:60]} | |")
                    continue
                print(f"| {K}x{N} | {rows} | {name} | {ms * 1e3:.0f} | {nbytes / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
