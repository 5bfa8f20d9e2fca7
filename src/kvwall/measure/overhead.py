"""The engine's fixed cost per layer per decode step on this machine: Python and torch dispatch.

A roofline counts bytes and FLOPs; on a CPU (and on a GPU without CUDA graphs) every op also pays a
fixed dispatch cost that no byte count shows. We measure it where it is nearly all there is: a decode
step of a tiny model (hidden 64, 12 layers), whose weights and cache are a few hundred KiB. The
fastest step time divided by (layers + 1, the embedding/head counting as one) is the per-layer cost
that `--device local` predictions add: a latency floor, so the minimum (other processes only ever add
to it), not the median.
"""

from __future__ import annotations

import time

TINY = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            torch_dtype="float32")


def engine_layer_overhead(steps: int = 40) -> float:
    """Seconds per layer per decode step of kvwall's engine on a tiny model (fastest of `steps`)."""
    import torch

    from kvwall.engine.caches import make_cache
    from kvwall.engine.model import Transformer
    from kvwall.spec.hf import spec_from_config

    spec = spec_from_config(TINY, name="tiny")
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
    return min(times) / (spec.n_layers + 1)


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


def attention_bandwidth(total_bytes: int = 512 << 20, runs: int = 5) -> float:
    """Bytes/s of the engine's decode attention (one token, 12 query heads over 4 KV heads of 64)
    over distinct cold caches of 8,192 tokens, through kvwall.engine.layers.attention.attend."""
    import torch

    from kvwall.engine.layers.attention import attend

    hkv, rep, d, s = 4, 3, 64, 8192
    per = 2 * hkv * s * d * 4
    caches = [(torch.randn(1, hkv, s, d), torch.randn(1, hkv, s, d)) for _ in range(max(2, total_bytes // per))]
    q = torch.randn(1, hkv * rep, 1, d)  # (B, Hq, T, D)
    mask = torch.ones(1, 1, 1, s, dtype=torch.bool)

    def sweep():
        for k, v in caches:
            attend(q, k, v, mask, d ** -0.5, None)  # (B, Hq, 1, D)

    with torch.inference_mode():
        return len(caches) * per / _fastest_time(sweep, runs)
