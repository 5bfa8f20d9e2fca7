"""The engine: PyTorch modules built from a ModelSpec, HF weights, KV caches and a decode loop.

Import cost: torch is imported by the submodules, never by ``kvwall`` itself.

    from kvwall.engine.load import load_model
    from kvwall.engine.generate import generate
    model = load_model("path/to/checkpoint")
    out = generate(model, [[1, 2, 3]], max_new_tokens=16, cache="contiguous")
"""

from kvwall.engine.caches.registry import CACHE_NAMES  # torch-free, for the CLI: the cache registry's names

__all__ = ["CACHE_NAMES"]
