"""DeepSeek Sparse Attention's decode attention over the top-k latents (engine/layers/sparse_latent.py picked_decode)
against the bytes it must read.

    python benchmarks/bench_dsa_decode.py [--context 32768] [--topk 2048] [--heads 16] [--runs 15] [--threads 1]
                                          [--out FILE.json]

DeepSeek-V3.2 (catalog/models/deepseek-v3.2.json): MLA latent r = 512, rope key d_r = 64, index_topk 2048, 128
heads (16 a GPU at tensor parallel 8, the default here). A decode step of one layer attends each row's query heads
over the 2048 picked latents: it must read 2048 x (512 + 64) x 4 B = 4.5 MiB (fp32), whatever the context. Timed
in turn, in one run (interleaved: the same load for each), for one layer at batch 1 over a cache of --context
tokens, the attention alone (the absorbed query given; the up-projections are the same matmuls either way):

- kernel: mla_decode_picked, the picked rows read where they lie in the cache (the decode fast path);
- gather+kernel: the picked rows gathered into a new tensor, then mla_decode over them (the path before it);
- gather+torch: the gather, then the torch absorbed attention (the fallback without a compiler);
- dense: mla_decode over every cached latent (MLA without the indexer: what DSA saves);
- gather only: copying the picked rows and nothing else (the least a read of those bytes costs here).

The attention is 2 H FLOPs per byte of latent read (H heads each take a dot product and a weighted sum over every
row), so with 16 heads it is compute-bound on a CPU core (about 8 FLOPs/byte at 13 GB/s and ~100 GFLOP/s); both
the bytes' and the FLOPs' rates are reported.
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

from kvwall.engine.layers.latent_kernel import mla_decode, mla_decode_picked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="also write the JSON to this file (benchmarks/results/dsa_decode.json)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    picked, dense = mla_decode_picked(), mla_decode()
    if picked is None or dense is None:
        raise SystemExit("the C++ kernel mla_decode did not build (see the warning above): nothing to compare")
    g = torch.Generator().manual_seed(0)
    S, k, H, r, dr = a.context, a.topk, a.heads, a.rank, a.rope
    c = torch.randn(1, S, r, generator=g)  # (B, S, r): the latent cache of one layer
    pe = torch.randn(1, S, dr, generator=g)  # (B, S, dr): the rope keys
    q = torch.randn(1, H, r + dr, generator=g) * 0.05  # (B, H, r + dr): [absorbed q_lat ; q_rot]
    top = torch.randperm(S, generator=g)[:k].sort().values[None]  # (B, k): the indexer's picks, in slot order
    rows = torch.zeros(1, 1, dtype=torch.long)  # (B, 1): row 0 is block 0 of S slots
    k_pos, p = top.clone(), torch.tensor([S - 1])  # every pick visible
    slots = torch.arange(S)[None]  # (1, S)
    scale = (128 + dr) ** -0.5
    lat = lambda: (c[0, top[0]][None], pe[0, top[0]][None])  # noqa: E731  (B, k, r), (B, k, dr)

    def torch_attention():
        cg, pg = lat()
        s = (q[:, :, :r] @ cg.transpose(1, 2) + q[:, :, r:] @ pg.transpose(1, 2)) * scale  # (B, H, k)
        return s.softmax(-1) @ cg  # (B, H, r)

    fns = {"kernel": lambda: picked(q, c, pe, rows, top, k_pos, p, scale),
           "gather+kernel": lambda: dense(q, *lat(), k_pos, p, scale),
           "gather+torch": torch_attention,
           "dense": lambda: dense(q, c, pe, slots, p, scale),
           "gather only": lat}
    ref = torch_attention()
    assert (fns["kernel"]() - ref).abs().max().item() < 1e-4 and (fns["gather+kernel"]() - ref).abs().max() < 1e-4
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(a.runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    t = {name: statistics.median(ts) for name, ts in times.items()}
    must = k * (r + dr) * 4  # bytes of the picked latents and rope keys
    flops = 2 * H * k * (r + dr) + 2 * H * k * r  # scores and weighted sum, 2 FLOPs a multiply-add
    out = {"seconds": t, "bytes_to_read": must, "flops": flops,
           "kernel_Bps": must / t["kernel"], "kernel_flops_per_s": flops / t["kernel"],
           "kernel_vs_gather_only": t["gather only"] / t["kernel"],
           "kernel_speedup_over_gather_kernel": t["gather+kernel"] / t["kernel"],
           "kernel_speedup_over_torch": t["gather+torch"] / t["kernel"], "dense_over_kernel": t["dense"] / t["kernel"],
           "context": S, "topk": k, "heads": H, "rank": r, "rope": dr, "runs": a.runs, "threads": a.threads,
           "load_average": list(os.getloadavg()), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python benchmarks/bench_dsa_decode.py " + " ".join(sys.argv[1:])}
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
