"""One architecture's benchmark, run in its own process so its peak resident memory is its own.

    python -m kvwall.measure.bench_worker '<json job>'   -> one JSON line per context on stdout

First, one short untimed prefill and decode step warm the process up (thread pools, allocator, and
the C++ kernels a first call builds, such as the Mamba scan), so no timing includes them. Then for
each context (ascending): time a real prefill when the context is at most `prefill_max` (the median
of a few, each into a fresh cache; fewer at long contexts, where one costs seconds), time decode
steps over the cache it filled (median after warm-up), and report every run, the cache's own byte
count and the process's peak RSS so far, then (profile_steps) a few more steps timed per part of the step
(timed_parts: each mixer kind's layers, the channel mixers, the rest). Contexts above `prefill_max` are
reached by writing random K/V through the cache's own update() (what a decode step reads does
not depend on the values), so a 32k point costs seconds, not minutes.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

import torch

from kvwall.errors import KvwallError


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build(job: dict):
    from kvwall.engine.model import Transformer
    from kvwall.spec.hf import spec_from_config

    if job.get("checkpoint"):
        from kvwall.engine.load import load_model

        return load_model(job["checkpoint"]).eval()
    torch.manual_seed(0)
    spec = spec_from_config(job["config"], name=job["name"], where=f"bench arch {job['name']}")
    model = Transformer(spec).eval()
    for p in model.parameters():  # a small, stable scale: random weights, finite activations
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    return model.prepack()  # projections as a loaded model holds them (oneDNN's layout where it runs)


def fill(model, cache, context: int, chunk: int = 1024) -> None:
    """Write `context` tokens of random K/V into every layer's KV cache (MLA: latent and rope key)."""
    from kvwall.engine.caches.base import attention_specs

    g = torch.Generator().manual_seed(1)
    layouts = attention_specs(model.spec)  # per layer: the K/V its cache holds, or None
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        pos = torch.arange(start, start + n)[None]  # (1, n)
        cache.step(pos)
        for i, m in enumerate(layouts):
            if m is not None:
                k = torch.randn(1, m.n_kv_heads, n, m.head_dim, generator=g)  # (1, Hkv, n, D)
                v = torch.randn(1, m.n_kv_heads, n, m.v_head_dim, generator=g)  # (1, Hkv, n, Dv)
                cache.update(i, k, v, pos)


def timed(fn, steps: int, warmup: int) -> list[float]:
    out = []
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


WARMUP_TOKENS = 64  # the untimed first prefill: long enough to take the chunked / C++ prefill paths


def prefill_repeats(context: int) -> int:
    """How many prefills to time at this context: three where one is cheap, one at 4k and beyond (seconds each)."""
    return 3 if context <= 1024 else (2 if context < 4096 else 1)


@torch.inference_mode()
def warm_up(model, job: dict) -> None:
    """One short prefill and one decode step, untimed: whatever the first model call pays is paid here."""
    from kvwall.engine.caches import make_cache

    n = min(WARMUP_TOKENS, min(job["contexts"]))
    cache = make_cache(job["cache"], model.spec, 1, n + 1)
    model(torch.ones(1, n, dtype=torch.long), torch.arange(n)[None], cache, last_only=True)
    model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[n]]), cache)


@torch.inference_mode()
def timed_prefills(model, job: dict, context: int, max_len: int):
    """Prefill `context` tokens into a fresh cache each time; the last cache and every run's seconds."""
    from kvwall.engine.caches import make_cache

    tokens = torch.randint(0, model.spec.vocab, (1, context), generator=torch.Generator().manual_seed(2))  # (1, T)
    runs = []
    for _ in range(prefill_repeats(context)):
        cache = make_cache(job["cache"], model.spec, 1, max_len)
        t0 = time.perf_counter()
        model(tokens, torch.arange(context)[None], cache, last_only=True)
        runs.append(time.perf_counter() - t0)
    return cache, runs


def timed_parts(model, step, n: int) -> dict | None:
    """n more decode steps with a clock around each block's sequence mixer and channel mixer (forward hooks), after
    the timed ones so that those carry no hook: the median seconds per step of "mixer:<kind>" (every layer of that
    mixer kind together), "ffn:<kind>", and "rest" (embedding, final norm, LM head and the glue between blocks:
    the step's time less the parts), plus "step" (the hooked step, a few hook calls slower than decode_s). None
    when no hook fired: the fused decode step (engine/decode_stack.py) runs every layer in one C++ call. Every one
    of the n steps runs either way, so that the cache holds the tokens bench.run predicts its bytes for."""
    clock, started, got = time.perf_counter, {}, {}

    def pre(key):
        return lambda module, args: started.__setitem__(key, clock())

    def post(key, part):
        return lambda module, args, out: got.__setitem__(part, got.get(part, 0.0) + clock() - started.pop(key))

    handles = []
    for i, (block, layer) in enumerate(zip(model.layers, model.spec.layers)):
        for which, module, kind in (("mixer", block.mixer, layer.mixer), ("ffn", block.ffn, layer.ffn)):
            if module is not None and kind is not None:
                handles += [module.register_forward_pre_hook(pre((i, which))),
                            module.register_forward_hook(post((i, which), f"{which}:{kind.kind}"))]
    runs = []
    try:
        for _ in range(n):
            got.clear()
            t0 = clock()
            step()
            total = clock() - t0
            if got:
                runs.append({**got, "rest": total - sum(got.values()), "step": total})
    finally:
        for h in handles:
            h.remove()
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} if runs else None


@torch.inference_mode()
def run_point(model, job: dict, context: int) -> dict:
    from kvwall.engine.caches import make_cache

    steps, warmup, profile = job["steps"], job["warmup"], job.get("profile_steps", 0)
    max_len = context + steps + warmup + profile  # exactly what the run writes: preallocating caches hold no spare
    prefill_runs = []
    if context <= job["prefill_max"]:
        cache, prefill_runs = timed_prefills(model, job, context, max_len)
    else:
        cache = make_cache(job["cache"], model.spec, 1, max_len)
        fill(model, cache, context)
    tok = torch.ones(1, 1, dtype=torch.long)
    state = {"pos": context}

    def step():
        model(tok, torch.tensor([[state["pos"]]]), cache)
        state["pos"] += 1

    times = timed(step, steps, warmup)
    parts = timed_parts(model, step, profile) if profile else None
    return {"arch": job["name"], "context": context, "decode_s": statistics.median(times), "decode_runs_s": times,
            "parts_s": parts,
            "prefill_s": statistics.median(prefill_runs) if prefill_runs else None, "prefill_runs_s": prefill_runs,
            "cache_bytes": cache.nbytes(), "peak_rss_bytes": peak_rss_bytes(),
            "params": sum(p.numel() for p in model.parameters())}


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    torch.set_num_threads(job.get("threads") or torch.get_num_threads())
    try:
        model = build(job)
        warm_up(model, job)
        for context in job["contexts"]:
            print(json.dumps({**run_point(model, job, context), "threads": torch.get_num_threads()}), flush=True)
    except KvwallError as exc:
        print(json.dumps({"arch": job["name"], "error": str(exc)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
