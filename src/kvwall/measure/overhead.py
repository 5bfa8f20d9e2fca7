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
