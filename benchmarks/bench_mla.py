"""MLA decode ms/token: naive (up-project the cached latent every step) vs absorbed (attend in latent space),
the absorbed path both in torch matmuls and through the engine's C++ kernel (its default on the CPU).

    .venv/bin/python benchmarks/bench_mla.py [--steps 7] [--contexts 128,1024,8192] [--batch 1] [--layers 4]

Model: DeepSeek-V2-Lite's attention exactly (16 heads, kv_lora_rank 512, rope key 64, q_nope 128,
v 128, no q LoRA, YaRN x40), hidden 2048, but `--layers` layers (V2-Lite has 27) with a dense
1408-wide MLP instead of its 64-expert MoE, so the step is mostly attention; random weights, fp32.
The cache is filled with `context` random latents (a real prefill of 8k tokens would take minutes
and does not change what one decode step reads). Each step is timed alone; the table has medians.
All paths run on the same model and cache in the same process, alternating step by step (a busy
machine then slows them alike, and the ratios stay honest).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvwall.engine.caches import make_cache
from kvwall.engine.layers import latent
from kvwall.engine.layers.latent import set_path
from kvwall.engine.model import Transformer
from kvwall.spec.hf import spec_from_config

V2_LITE_ATTENTION = dict(
    model_type="deepseek_v2", vocab_size=1024, hidden_size=2048, intermediate_size=1408, num_attention_heads=16,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=163840, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
)
PATHS = ("naive", "absorbed-torch", "absorbed")
KERNEL = latent.mla_decode


def use(model: Transformer, path: str) -> None:
    set_path(model, "naive" if path == "naive" else "absorbed")
    latent.mla_decode = (lambda: None) if path == "absorbed-torch" else KERNEL  # None: the torch matmul path


def build(layers: int) -> Transformer:
    spec = spec_from_config(dict(V2_LITE_ATTENTION, num_hidden_layers=layers), name="v2-lite-attention")
    model = Transformer(spec).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


def filled_cache(model: Transformer, batch: int, context: int, steps: int):
    """A contiguous latent cache already holding `context` random (latent, rope key) entries per layer."""
    cache = make_cache("contiguous", model.spec, batch, context + steps + 4)
    g = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        layer.k[:, :, :context] = torch.randn(batch, 1, context, layer.k.shape[-1], generator=g)  # latent c_kv
        layer.v[:, :, :context] = torch.randn(batch, 1, context, layer.v.shape[-1], generator=g)  # rope key
    cache.length = context
    return cache


@torch.inference_mode()
def bench(model, cache, batch: int, context: int, steps: int, warmup: int = 2) -> dict[str, float]:
    """Median ms of one decode step per path; the paths alternate step by step, so both see the same machine."""
    tok = torch.ones(batch, 1, dtype=torch.long)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(steps + warmup):
        pos = torch.full((batch, 1), context + i)  # both paths write the same token at the same position
        for path in PATHS:
            use(model, path)
            t0 = time.perf_counter()
            model(tok, pos, cache)
            if i >= warmup:
                times[path].append((time.perf_counter() - t0) * 1e3)
    return {p: statistics.median(t) for p, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--contexts", default="128,1024,8192")  # the contexts the README quotes
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.layers)
    m = model.spec.layers[0].mixer
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters, {args.layers} MLA layers ({m.describe()}), fp32; "
          f"torch {torch.__version__}, {args.threads} threads; batch {args.batch}; median of {args.steps} steps")
    assert KERNEL() is not None, "the MLA kernel did not build (no C++ compiler or ninja?)"
    print("| context | naive ms/tok | absorbed (torch) ms/tok | absorbed (kernel) ms/tok | kernel vs naive | "
          "kernel vs torch absorbed | latent cache MiB | expanded K/V MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for context in map(int, args.contexts.split(",")):
        cache = filled_cache(model, args.batch, context, args.steps)
        ms = bench(model, cache, args.batch, context, args.steps)
        naive, torch_absorbed, absorbed = ms["naive"], ms["absorbed-torch"], ms["absorbed"]
        latent_mib = args.batch * context * args.layers * m.cache_elems_per_token() * 4
        expanded = args.batch * context * args.layers * m.n_heads * (m.qk_head_dim + m.v_head_dim) * 4
        print(f"| {context} | {naive:.1f} | {torch_absorbed:.1f} | {absorbed:.1f} | {naive / absorbed:.1f}x | "
              f"{torch_absorbed / absorbed:.1f}x | {latent_mib / 2**20:.0f} | {expanded / 2**20:.0f} |", flush=True)
        del cache


if __name__ == "__main__":
    main()
