"""The engine's fixed cost per layer per decode step on this machine: Python and torch dispatch.

A roofline counts bytes and FLOPs; on a CPU (and on a GPU without CUDA graphs) every op also pays a
fixed dispatch cost that no byte count shows. We measure it where it is nearly all there is: decode
steps of tiny models (hidden 64) whose weights and cache are a few hundred KiB, at 2 and at 10 blocks
of each kind. The slope is the per-layer cost `--device local` predictions add, the intercept the
per-step rest. Each is the fastest step: a latency floor (other processes only ever add to it).
"""

from __future__ import annotations

import time

TINY = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            torch_dtype="float32")

# One tiny model per kind of block: its per-layer cost is the slope of step time over depth.
TINY_KINDS = {
    "attention": TINY,
    "latent": dict(model_type="deepseek_v2", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=None,
                   first_k_dense_replace=64, max_position_embeddings=4096, torch_dtype="float32"),
    "mamba": dict(model_type="mamba", vocab_size=128, hidden_size=64, state_size=16, expand=2, conv_kernel=4,
                  intermediate_size=128, time_step_rank="auto", tie_word_embeddings=False, torch_dtype="float32"),
    "mamba2": dict(model_type="mamba2", vocab_size=128, hidden_size=64, num_heads=8, head_dim=16, state_size=16,
                   n_groups=1, expand=2, conv_kernel=4, tie_word_embeddings=False, torch_dtype="float32"),
}


def _step_time(config: dict, layers: int, steps: int) -> float:
    """Fastest decode step of a tiny model of `layers` blocks (a latency floor: others only slow it)."""
    import torch

    from kvwall.engine.caches import make_cache
    from kvwall.engine.model import Transformer
    from kvwall.spec.hf import spec_from_config

    spec = spec_from_config(dict(config, num_hidden_layers=layers), name="tiny")
    torch.manual_seed(0)
    model = Transformer(spec).eval()
    cache = make_cache("contiguous", spec, 1, 64 + steps + 4)
    times = []
    with torch.inference_mode():
        model(torch.ones(1, 64, dtype=torch.long), torch.arange(64)[None], cache)
        for i in range(steps + 4):
            t0 = time.perf_counter()
            model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[64 + i]]), cache)
            if i >= 4:
                times.append(time.perf_counter() - t0)
    return min(times)


def engine_overheads(steps: int = 40) -> dict[str, float]:
    """Per-layer dispatch cost by kind of block, and the per-step cost outside the blocks ("step"):
    from tiny models of 2 and 10 blocks, slope = per layer, intercept = the rest."""
    out = {}
    for kind, cfg in TINY_KINDS.items():
        t2, t10 = _step_time(cfg, 2, steps), _step_time(cfg, 10, steps)
        out[kind] = max((t10 - t2) / 8, 0.0)
        if kind == "attention":
            out["step"] = max(t2 - 2 * out[kind], 0.0)
    return out


# -- achievable bandwidth of the two kinds of traffic a decode step makes --------------------------
#
# A decode step streams weights through matrix-vector products and the KV cache through attention.
# On a CPU neither reaches the plain streaming-read figure (small per-op work, thread sync, the
# attention kernel's own arithmetic), so `--device local` times each kind of op at the bandwidth the
# engine's own kernels reach on cold data, measured here. Both use buffers far larger than the caches.

def _fastest_time(fn, runs: int) -> float:
    """The fastest of `runs` timed runs after one warm-up: what the kernels can reach (another process on
    the machine only ever slows a run down, never speeds it up)."""
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def matvec_bandwidth(total_bytes: int = 512 << 20, runs: int = 5) -> float:
    """Bytes/s of a chain of F.linear calls over distinct (3072 x 768) fp32 weights, one token."""
    import torch
    import torch.nn.functional as F

    shape = (3072, 768)
    mats = [torch.randn(*shape) for _ in range(max(2, total_bytes // (shape[0] * shape[1] * 4)))]
    x = torch.randn(1, 1, shape[1])  # (B, T, in)

    def chain():
        for w in mats:
            F.linear(x, w)  # (1, 1, out)

    with torch.inference_mode():
        return sum(w.nbytes for w in mats) / _fastest_time(chain, runs)


DECODE_SHAPE = (4, 3, 64, 8192)  # KV heads, query heads per KV head, head dim, cached tokens: the bench's GQA layer


def attention_bandwidth(total_bytes: int = 512 << 20, runs: int = 5) -> float:
    """Bytes/s of the engine's decode attention (one token, 12 query heads over 4 KV heads of 64)
    over distinct cold caches of 8,192 tokens, through kvwall.engine.layers.attention.attend."""
    import torch

    from kvwall.engine.layers.attention import attend

    hkv, rep, d, s = DECODE_SHAPE
    per = 2 * hkv * s * d * 4
    caches = [(torch.randn(1, hkv, s, d), torch.randn(1, hkv, s, d)) for _ in range(max(2, total_bytes // per))]
    q = torch.randn(1, hkv * rep, 1, d)  # (B, Hq, T, D)
    mask = torch.ones(1, 1, 1, s, dtype=torch.bool)

    def sweep():
        for k, v in caches:
            attend(q, k, v, mask, d ** -0.5, None)  # (B, Hq, 1, D)

    with torch.inference_mode():
        return len(caches) * per / _fastest_time(sweep, runs)


QUANT_BUDGET_S = 6.0  # seconds one format's measurement may take


def quantized_attention_bandwidth(fmt: str, total_bytes: int = 512 << 20, runs: int = 5) -> float:
    """Bytes/s (packed bytes, scales included) of the engine's decode step through a KIVI cache of this format
    (int8, int4, int2): the shape of attention_bandwidth, each sweep appending one token to every cache and
    attending over it as QuantizedCache does at decode (the C++ kernel where it builds)."""
    import torch

    from kvwall.engine.caches.quantized import QuantizedCache
    from kvwall.spec.formats import get_format
    from kvwall.spec.model import MLP, Attention, Layer, ModelSpec

    hkv, rep, d, s = DECODE_SHAPE
    spec = ModelSpec("calibration", "llama", hkv * rep * d, 2, (Layer(Attention(hkv * rep, hkv, d, d), MLP(d)),))
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)

    def filled():
        cache = QuantizedCache(spec, 1, s + runs + 2, get_format(fmt))
        cache.update(0, keys, values, torch.arange(s)[None])
        return cache

    q, k1, v1 = torch.randn(1, hkv * rep, 1, d), torch.randn(1, hkv, 1, d), torch.randn(1, hkv, 1, d)
    t0 = time.perf_counter()
    first = filled()
    with torch.inference_mode():
        first.attend(0, q, k1, v1, torch.tensor([[s]]), d ** -0.5, None, None)
    one_s = time.perf_counter() - t0  # filling one cache and one step over it
    # as many caches as fill the byte target, or as fit the time budget where the kernel is slow
    # (no AVX2: int2 ran at 0.2 GB/s and 512 MiB of caches took 178 s, measured)
    count = max(2, min(total_bytes // first.nbytes(), int(QUANT_BUDGET_S / ((runs + 2) * one_s))))
    caches = [filled() for _ in range(count)]
    step = {"pos": s}

    def sweep():
        pos = torch.tensor([[step["pos"]]])
        for cache in caches:
            cache.attend(0, q, k1, v1, pos, d ** -0.5, None, None)  # (1, Hq, 1, D)
        step["pos"] += 1

    with torch.inference_mode():
        return sum(c.nbytes() for c in caches) / _fastest_time(sweep, runs)
