"""Decode ms/token: kvwall's engine against transformers on the same ~200M Llama-shaped random weights.

    .venv/bin/python benchmarks/bench_attention_decode.py [--steps 8] [--contexts 128,2048,8192] [--batches 1,8]

Model: hidden 1024, 12 layers, 16 query / 4 KV heads (head_dim 64), MLP 2816, vocab 32000, untied, fp32.
Both engines get the same weights (saved once with transformers, loaded by each), the same token,
and a cache already holding `context` tokens of random K/V (a prefill of 8k x 8 tokens would take
minutes on a CPU and does not change what one decode step reads). Each step is timed alone;
the table reports medians. Achieved bandwidth = bytes one step must read / median step time, where
the bytes are the whole cache and every weight except the input embedding: that table is untied and
a step gathers only one row of it per token (counting all of it, as this script once did, overstated
the GB/s by 16-19 %); the output head, a separate matrix, is read in full.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers
from transformers import DynamicCache

from kvwall.engine.caches import ContiguousCache
from kvwall.engine.load import load_model

from timing import median_ms  # benchmarks/timing.py (the script folder is on sys.path)

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384,
              tie_word_embeddings=False)


def random_kv(batch, context, g):
    return [(torch.randn(batch, 4, context, 64, generator=g), torch.randn(batch, 4, context, 64, generator=g))
            for _ in range(12)]


@torch.inference_mode()
def bench_kvwall(model, kv, batch, context, steps) -> float:
    cache = ContiguousCache(model.spec, batch, context + steps + 4)
    for layer, (k, v) in zip(cache.layers, kv):
        layer.k[:, :, :context], layer.v[:, :, :context] = k, v
    cache.length = context
    tok = torch.ones(batch, 1, dtype=torch.long)
    state = {"pos": context}

    def step():
        model(tok, torch.full((batch, 1), state["pos"]), cache)
        state["pos"] += 1

    return median_ms(step, steps)


@torch.inference_mode()
def bench_transformers(model, kv, batch, context, steps) -> float:
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    tok = torch.ones(batch, 1, dtype=torch.long)
    state = {"pos": context}

    def step():
        p = state["pos"]
        model(tok, past_key_values=cache, use_cache=True, position_ids=torch.full((batch, 1), p),
              cache_position=torch.tensor([p]))
        state["pos"] += 1

    return median_ms(step, steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--contexts", default="128,2048,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    with tempfile.TemporaryDirectory() as d:
        transformers.LlamaForCausalLM(cfg).save_pretrained(d)
        ref = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        mine = load_model(d)
    params = sum(p.numel() for p in mine.parameters())
    embedding = CONFIG["vocab_size"] * CONFIG["hidden_size"]
    read_params = params - embedding  # what a step streams: all but the input embedding, of which it gathers rows
    print(f"model: {params / 1e6:.1f}M parameters, fp32, {read_params * 4 / 2**20:.0f} MiB read per step; "
          f"torch {torch.__version__}, "
          f"transformers {transformers.__version__} ({ref.config._attn_implementation}), {args.threads} threads; "
          f"median of {args.steps} steps")
    print("| batch | context | kvwall ms/tok | transformers ms/tok | speedup | cache MiB | kvwall GB/s |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            kv = random_kv(batch, context, g)
            ms_k = bench_kvwall(mine, kv, batch, context, args.steps)
            ms_t = bench_transformers(ref, kv, batch, context, args.steps)
            cache_bytes = 2 * 12 * 4 * 64 * 4 * context * batch
            weight_bytes = (read_params + batch * CONFIG["hidden_size"]) * 4  # + one embedding row per sequence
            gbs = (weight_bytes + cache_bytes) / (ms_k / 1e3) / 1e9
            print(f"| {batch} | {context} | {ms_k:.1f} | {ms_t:.1f} | {ms_t / ms_k:.2f}x | "
                  f"{cache_bytes / 2**20:.0f} | {gbs:.1f} |", flush=True)
            del kv


if __name__ == "__main__":
    main()
