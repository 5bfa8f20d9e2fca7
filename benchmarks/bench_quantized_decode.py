"""One layer's decode attention over a KIVI cache: the packed-byte kernel against dequantize-then-attend,
with fp32 attention over an fp32 cache of the same tokens as the baseline.

    .venv/bin/python benchmarks/bench_quantized_decode.py [--contexts 1024,8192,32768] [--runs 9] [--threads 2]

Shape: 12 query heads over 4 KV heads of 64 (the bench's GQA layer), batch 1, random K/V. Per context and
format: ms per call (median of --runs), the cache's bytes, and the largest difference between the two
quantized paths' outputs (they compute the same attention over the same rounded values).

Every format is read cold, from DRAM: each call attends over the next of enough separate copies of the
cache (together at least twice the last-level cache and 256 MiB, as kvwall.measure.overhead does), so
a small int8 cache cannot stay in the L3 between calls while a 4x larger fp32 one does not. (Before
2026-12-01 this script re-read one cache every call, which favoured the smaller formats at 32k.)
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from kvwall.engine.caches.quant_kernel import quantized_decode
from kvwall.engine.caches.quantized import QuantizedLayer
from kvwall.engine.layers.attention import attend, visible
from kvwall.measure.machine import llc_bytes
from kvwall.spec.formats import get_format
from kvwall.spec.model import Attention

from timing import median_ms  # benchmarks/timing.py (the script folder is on sys.path)

H, REP, D = 4, 3, 64
MIN_SWEEP_BYTES = 256 << 20  # the copies read in turn together: past any last-level cache


def rotation(items: list):
    """Each call returns the next item: with copies past the last-level cache, each is read from DRAM."""
    it = itertools.cycle(items)
    return lambda: next(it)


def copies_needed(one: int, total: int) -> int:
    return max(2, math.ceil(total / one))


def quantized(S: int, name: str, k, v) -> QuantizedLayer:
    layer = QuantizedLayer(Attention(H * REP, H, D, D), 1, S + 8, get_format(name), 32, torch.float32, "cpu")
    layer.append(0, k[0], v[0])
    return layer


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--formats", default="int8,int4,int2")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = quantized_decode()
    assert kernel is not None, "the kernel did not build (no C++ compiler or ninja?)"
    sweep = max(2 * (llc_bytes() or 0), MIN_SWEEP_BYTES)
    g = torch.Generator().manual_seed(0)
    print(f"one layer, {H * REP} query heads over {H} KV heads of {D}, batch 1; {args.threads} threads; "
          f"median of {args.runs} calls, each over the next of copies totalling >= {sweep / 2**20:.0f} MiB (cold)")
    print("| context | cache | MiB | packed-byte kernel ms | dequantize + attend ms | speed-up | fp32 cache ms | "
          "max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for S in map(int, args.contexts.split(",")):
        k, v = torch.randn(1, H, S, D, generator=g), torch.randn(1, H, S, D, generator=g)  # (1, H, S, D)
        q = torch.randn(1, H * REP, 1, D, generator=g)  # (1, Hq, 1, D)
        pos = torch.tensor([[S - 1]])
        mask = visible(pos, torch.arange(S)[None], None)
        fp32 = rotation([(k.clone(), v.clone()) for _ in range(copies_needed(2 * k.nbytes, sweep))])
        # bound, not closed over: `del fp32` frees the copies once the lambda is gone
        ms_fp32 = median_ms(lambda fp32=fp32, q=q, mask=mask: attend(q, *fp32(), mask, D ** -0.5, None), args.runs)
        del fp32
        print(f"| {S} | fp32 | {2 * k.nbytes / 2**20:.1f} | – | – | – | {ms_fp32:.2f} | – |", flush=True)
        for name in args.formats.split(","):
            first = quantized(S, name, k, v)
            layers = [first] + [quantized(S, name, k, v) for _ in range(copies_needed(first.nbytes(), sweep) - 1)]
            next_fast, next_slow = rotation(layers), rotation(layers)

            def dequantized(layer=None, next_slow=next_slow, q=q, pos=pos):
                k_all, v_all, k_pos = (layer or next_slow()).read(torch.float32)
                return attend(q, k_all, v_all, visible(pos, k_pos, None), D ** -0.5, None)

            def fast(layer=None, next_fast=next_fast, q=q, pos=pos):
                return (layer or next_fast()).attend_decode(q, pos, D ** -0.5, None, kernel)

            ms_k, ms_d = median_ms(fast, args.runs), median_ms(dequantized, args.runs)
            diff = (fast(first) - dequantized(first)).abs().max().item()
            print(f"| {S} | {name} | {first.nbytes() / 2**20:.1f} | {ms_k:.2f} | {ms_d:.2f} | {ms_d / ms_k:.1f}x | "
                  f"{ms_fp32:.2f} | {diff:.1e} |", flush=True)
            del layers, first


if __name__ == "__main__":
    main()
