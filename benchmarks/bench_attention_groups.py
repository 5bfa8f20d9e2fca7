"""Decode attention's reachable bandwidth by how many query heads share a KV head (MHA 1, GQA 3, MQA 12).

    .venv/bin/python benchmarks/bench_attention_groups.py [--contexts 4096,32768] [--runs 5]

12 query heads of 64, one new token, batch 1, through kvwall.engine.layers.attention.attend (torch SDPA)
over distinct cold fp32 caches (256 MiB in all per point, so nothing is re-read from cache). The same
byte count per token buys different speeds: with 12 heads on one KV head the step is a skinny
12-row matmul per layer, with one head per KV head it is 12 independent streams. `kvwall calibrate`
measures the GQA point only, which is why the bench's MHA and MQA predictions part ways at long context.
"""

from __future__ import annotations

import argparse

import torch

from kvwall.engine.layers.attention import attend, visible

from timing import median_ms  # benchmarks/timing.py (the script folder is on sys.path)

HEADS, D, TOTAL = 12, 64, 256 << 20


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"decode attention, {HEADS} query heads of {D}, batch 1, fp32, {args.threads} threads; "
          f"median of {args.runs} sweeps over {TOTAL >> 20} MiB of caches")
    print("| context | KV heads | query heads per KV head | cache MiB per layer | ms per layer | GB/s | GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for S in map(int, args.contexts.split(",")):
        for hkv in (12, 4, 1):
            per = 2 * hkv * S * D * 4
            caches = [(torch.randn(1, hkv, S, D), torch.randn(1, hkv, S, D)) for _ in range(max(2, TOTAL // per))]
            q = torch.randn(1, HEADS, 1, D)
            mask = visible(torch.tensor([[S - 1]]), torch.arange(S)[None], None)

            def sweep(caches=caches, q=q, mask=mask):
                for k, v in caches:
                    attend(q, k, v, mask, D ** -0.5, None)

            ms = median_ms(sweep, args.runs, warmup=1) / len(caches)
            flops = 2 * HEADS * S * 2 * D
            print(f"| {S} | {hkv} | {HEADS // hkv} | {per / 2**20:.1f} | {ms:.2f} | {per / ms / 1e6:.1f} | "
                  f"{flops / ms / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
