"""One layer's decode attention over a KIVI cache: the packed-byte kernel against dequantize-then-attend,
with fp32 attention over an fp32 cache of the same tokens as the baseline.

    .venv/bin/python benchmarks/bench_quantized_decode.py [--contexts 1024,8192,32768] [--runs 9] [--threads 2]

Shape: 12 query heads over 4 KV heads of 64 (the bench's GQA layer), batch 1, random K/V. Per context and
format: ms per call (median of --runs), the cache's bytes, and the largest difference between the two
quantized paths' outputs (they compute the same attention over the same rounded values).
"""

from __future__ import annotations

import argparse

import torch

from kvwall.engine.caches.quant_kernel import quantized_decode
from kvwall.engine.caches.quantized import QuantizedLayer
from kvwall.engine.layers.attention import attend, visible
from kvwall.predict.formats import get_format
from kvwall.spec.model import Attention

from timing import median_ms  # benchmarks/timing.py (the script folder is on sys.path)

H, REP, D = 4, 3, 64


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
    g = torch.Generator().manual_seed(0)
    print(f"one layer, {H * REP} query heads over {H} KV heads of {D}, batch 1; {args.threads} threads; "
          f"median of {args.runs} calls")
    print("| context | cache | MiB | packed-byte kernel ms | dequantize + attend ms | speed-up | fp32 cache ms | "
          "max diff |")
    print("|---|---|---|---|---|---|---|---|")
    for S in map(int, args.contexts.split(",")):
        k, v = torch.randn(1, H, S, D, generator=g), torch.randn(1, H, S, D, generator=g)
        q = torch.randn(1, H * REP, 1, D, generator=g)
        pos = torch.tensor([[S - 1]])
        mask = visible(pos, torch.arange(S)[None], None)
        ms_fp32 = median_ms(lambda: attend(q, k, v, mask, D ** -0.5, None), args.runs)
        print(f"| {S} | fp32 | {2 * k.nbytes / 2**20:.1f} | – | – | – | {ms_fp32:.2f} | – |", flush=True)
        for name in args.formats.split(","):
            layer = QuantizedLayer(Attention(H * REP, H, D, D), 1, S + 8, get_format(name), 32, torch.float32, "cpu")
            layer.append(0, k[0], v[0])

            def dequantized():
                k_all, v_all, k_pos = layer.read(torch.float32)
                return attend(q, k_all, v_all, visible(pos, k_pos, None), D ** -0.5, None)

            fast = lambda: layer.attend_decode(q, pos, D ** -0.5, None, kernel)  # noqa: E731
            ms_k, ms_d = median_ms(fast, args.runs), median_ms(dequantized, args.runs)
            diff = (fast() - dequantized()).abs().max().item()
            print(f"| {S} | {name} | {layer.nbytes() / 2**20:.1f} | {ms_k:.2f} | {ms_d:.2f} | {ms_d / ms_k:.1f}x | "
                  f"{ms_fp32:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
