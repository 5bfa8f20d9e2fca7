"""One real model's decode speed, kvwall's engine (each cache) against transformers, in one process.

    python -m kvwall.measure.real_worker '<json job>'   -> one JSON line per (batch, engine) on stdout

Both engines load the same .gguf in fp32 (transformers dequantizes it on load, as kvwall does). For each
batch size both get the same prompt (random token ids, fixed seed) and decode greedily; then their decode
steps are timed interleaved, one step of each engine in turn (kvwall with each cache, transformers), so
that a busy machine slows them alike, and each reports the median step after `warmup` untimed ones.
Each line also says whether its greedy tokens equal transformers' (an exact cache should).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from kvwall.engine.generate import greedy  # every engine's pick: the same argmax, numpy's on the CPU
from kvwall.engine.threads import ThreadGovernor, step_on


class Engine:
    """A model mid-generation: its cache (when it keeps one outside), the last token of each row, the step count."""

    name = ""
    key = "transformers"  # unique among the engines of one run
    weights = "fp32"  # what --weights the engine holds (transformers: the fp32 load)

    def step(self) -> None:
        raise NotImplementedError

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0


class KvwallEngine(Engine):
    def __init__(self, model, cache: str, prompt: torch.Tensor, max_len: int, weights: str = "fp32",
                 adapt_threads: bool = False):
        from kvwall.engine.caches import make_cache

        self.name, self.model, self.weights = f"kvwall:{cache}", model, weights
        self.key = f"{self.name}@{weights}"  # the name twice under two weight formats
        self.cache = make_cache(cache, model.spec, prompt.shape[0], max_len)
        self.cache_name = cache
        logits = model(prompt, None, self.cache, last_only=True)  # (B, 1, V)
        self.tok = greedy(logits[:, -1])[:, None]  # (B, 1)
        self.pos, self.tokens = prompt.shape[1], [self.tok]
        self.governor = ThreadGovernor() if adapt_threads else None  # made after the prefill: decode steps only

    def step(self) -> None:
        pos = torch.full((self.tok.shape[0], 1), self.pos, dtype=torch.long)  # (B, 1)
        with step_on(self.governor):
            logits = self.model(self.tok, pos, self.cache)[:, -1]  # (B, V)
        self.tok = greedy(logits)[:, None]  # (B, 1)
        self.pos += 1
        self.tokens.append(self.tok)

    def close(self) -> None:
        if self.governor:
            self.governor.close()


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model, prompt: torch.Tensor):
        out = model(input_ids=prompt, use_cache=True)
        self.model, self.past = model, out.cache
        self.tok = greedy(out.logits[:, -1])[:, None]  # (B, 1)
        self.tokens = [self.tok]

    def step(self) -> None:
        out = self.model(input_ids=self.tok, cache=self.past, use_cache=True)
        self.past = out.cache
        self.tok = greedy(out.logits[:, -1])[:, None]  # (B, 1)
        self.tokens.append(self.tok)


def load_transformers(path: str):
    """transformers' model of the same .gguf in fp32, or the reason it cannot be had."""
    from pathlib import Path

    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()  # its deprecation notices and progress bars would bury the results
        logging.disable_progress_bar()
        p = Path(path)
        return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval(), None
    except ImportError as exc:
        return None, f"transformers is not installed ({exc})"
    except Exception as exc:  # transformers' own loading failure: reported, kvwall still runs
        return None, f"transformers could not load it ({type(exc).__name__}: {exc})"


def interleaved(engines: list[Engine], steps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each timed step per engine, the engines taking turns step by step."""
    times: dict[str, list[float]] = {e.key: [] for e in engines}
    for i in range(warmup + steps):
        for e in engines:
            t = e.timed_step()
            if i >= warmup:
                times[e.key].append(t)
    return times


def same_tokens(e: Engine, ref: Engine | None) -> bool | None:
    if ref is None:
        return None
    return bool(torch.equal(torch.cat(e.tokens, 1), torch.cat(ref.tokens, 1)))


@torch.inference_mode()
def run_batch(models: dict, hf, job: dict, batch: int) -> list[dict]:
    """models: --weights value -> the kvwall model holding its weights that way (one engine per cache each)."""
    spec = next(iter(models.values())).spec
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, spec.vocab, (batch, job["prompt"]), generator=gen)  # (B, T)
    max_len = job["prompt"] + job["warmup"] + job["steps"] + 1
    engines: list[Engine] = [KvwallEngine(m, c, prompt, max_len, w) for w, m in models.items() for c in job["caches"]]
    ref = TransformersEngine(hf, prompt) if hf is not None else None
    engines += [ref] if ref is not None else []
    times = interleaved(engines, job["steps"], job["warmup"])
    out = []
    for e in engines:
        med = statistics.median(times[e.key])
        out.append({"arch": job["name"], "batch": batch, "engine": e.name, "cache": getattr(e, "cache_name", None),
                    "weights": e.weights, "step_s": med, "tok_s": batch / med,
                    "step_runs_s": times[e.key], "threads": torch.get_num_threads(),  # every engine: this process's
                    "cache_bytes": e.cache.nbytes() if isinstance(e, KvwallEngine) else None,
                    "same_tokens_as_transformers": None if e is ref else same_tokens(e, ref)})
    return out


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    torch.set_num_threads(job.get("threads") or torch.get_num_threads())
    from kvwall.engine.load import load_model
    from kvwall.errors import KvwallError

    try:
        models = {w: load_model(job["checkpoint"], weights=w) for w in job.get("weights") or ["fp32"]}
    except KvwallError as exc:
        print(json.dumps({"arch": job["name"], "error": str(exc)}), flush=True)
        return 0
    hf, why = load_transformers(job["checkpoint"]) if job.get("transformers", True) else (None, "not asked for")
    if why:
        print(json.dumps({"arch": job["name"], "error": f"transformers side skipped: {why}"}), flush=True)
    for batch in job["batches"]:
        for line in run_batch(models, hf, job, batch):
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
