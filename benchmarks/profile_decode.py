"""Where one decode step's time goes: kvwall's engine against transformers on the same real model.

    python benchmarks/profile_decode.py [MODEL] [--batch 1,16] [--prompt 16] [--steps 8] [--top 15] [--threads 2]

MODEL is a short name (smollm2-135m, gemma-3-270m) or a .gguf file; both engines load the same file in
fp32. For each batch size: prefill a prompt of `--prompt` tokens, then
  1. count the aten ops one decode step dispatches (a TorchDispatchMode: exact, not distorted by load),
     in total and per layer;
  2. profile one step of each (torch.profiler, self CPU time by op) and print the top ops;
  3. time `--steps` decode steps interleaved (kvwall, transformers, kvwall, ...) in this one process and
     print the median of each and their ratio (on a shared machine only the ratio means much).

Both engines run in this process on `--threads` torch threads (default 2, this machine's cores), and the window
timed is the same for both: one bare forward of one token per row plus its argmax, no sampler, no generate loop.
That is not the window of vLLM's LLM.generate: to set kvwall beside vLLM, use profile_vllm_step.py, which times
both engines' own generate calls end to end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Kvwall:
    """kvwall's engine: prefill into a contiguous cache, then one token per row per step."""

    name = "kvwall"

    def __init__(self, path, batch: int, prompt: torch.Tensor, max_new: int, cache: str = "contiguous"):
        from kvwall.engine.caches import make_cache
        from kvwall.engine.load import load_model

        self.model = load_model(path)
        self.cache = make_cache(cache, self.model.spec, batch, prompt.shape[1] + max_new)
        self.pos = prompt.shape[1]
        logits = self.model(prompt, None, self.cache, last_only=True)  # (B, 1, V)
        self.tok = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)

    def step(self) -> None:
        B = self.tok.shape[0]
        pos = torch.full((B, 1), self.pos, dtype=torch.long)
        self.tok = self.model(self.tok, pos, self.cache)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        self.pos += 1


class HF:
    """transformers on the same .gguf (dequantized to fp32 on load), a DynamicCache, one token per step."""

    name = "transformers"

    def __init__(self, path, batch: int, prompt: torch.Tensor, max_new: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        out = self.model(input_ids=prompt, use_cache=True)
        self.past = out.cache
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)

    def step(self) -> None:
        out = self.model(input_ids=self.tok, cache=self.past, use_cache=True)
        self.past = out.cache
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)


def count_ops(engine) -> Counter:
    with torch.inference_mode(), OpCounter() as c:
        engine.step()
    return c.ops


def profile_table(engine, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def interleaved(engines, steps: int) -> dict[str, float]:
    """Median seconds per step of each engine, steps interleaved so that load hits them alike."""
    times = {e.name: [] for e in engines}
    with torch.inference_mode():
        for _ in range(steps):
            for e in engines:
                t0 = time.perf_counter()
                e.step()
                times[e.name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both engines (default 2: this "
                    "machine's cores)")
    ap.add_argument("--no-profile", action="store_true", help="op counts and timings only")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from kvwall.spec.gguf_meta import gguf_file

    path = gguf_file(a.model)
    torch.manual_seed(0)
    for batch in (int(b) for b in a.batch.split(",")):
        prompt = torch.randint(0, 10000, (batch, a.prompt))  # (B, T)
        engines = [Kvwall(path, batch, prompt, 4 * a.steps + 8), HF(path, batch, prompt, 4 * a.steps + 8)]
        n_layers = engines[0].model.spec.n_layers
        print(f"\n=== {a.model}, batch {batch}, prompt {a.prompt}, {torch.get_num_threads()} threads for both "
              "(bare forward + argmax) ===")
        for e in engines:
            e.step()  # warm: the first step of each pays one-time costs
            ops = count_ops(e)
            total = sum(ops.values())
            print(f"{e.name}: {total} aten ops per decode step ({total / n_layers:.1f} per layer incl. the ends)")
            print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(20)))
        if not a.no_profile:
            for e in engines:
                print(f"--- {e.name}: self CPU time by op, one step ---")
                print(profile_table(e, a.top))
        med = interleaved(engines, a.steps)
        k, h = med["kvwall"], med["transformers"]
        print(f"interleaved median of {a.steps} steps: kvwall {k * 1e3:.1f} ms ({batch / k:.1f} tok/s), "
              f"transformers {h * 1e3:.1f} ms ({batch / h:.1f} tok/s); kvwall / transformers speed {h / k:.2f}x")


if __name__ == "__main__":
    main()
