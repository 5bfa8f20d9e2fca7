"""Where a served decode step's time goes, op by op, next to what the op model predicts for it.

    .venv/bin/python benchmarks/profile_serve_step.py [--model smollm2-135m] [--prompt 128] [--steps 20]
        [--batch 1]

`--batch` requests (each a `--prompt`-token random prompt) through kvwall.serve.runner with an fp32 pool, then
decode steps of all of them together timed four ways (at a batch above 1 the forward-only and contiguous timings
are of the first request alone): the runner's whole step (schedule, forward over the paged pool, sampling); the
model's forward alone over the same pool; the forward over a contiguous cache (what `kvwall calibrate` times its
per-layer cost on); and torch.profiler's self time per aten op over the runner's steps (matmuls split by weight
shape, so the LM head shows apart from the projections). The prediction is `kvwall roofline MODEL --device local`
(needs `kvwall calibrate` first); this prints the measured side. Run it on a quiet machine, under the bench lock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvwall.engine.caches import make_cache
from kvwall.engine.load import load_model
from kvwall.serve.runner import Runner
from kvwall.serve.scheduler import Request
from kvwall.spec.gguf_meta import gguf_file


def median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def decoding_runner(model, prompt: int, steps: int, batch: int = 1) -> tuple[Runner, Request]:
    """A runner holding `batch` requests that have prefilled and decode together for at least `steps` * 4
    more steps; returns the runner and the first request."""
    runner = Runner(model, kv_memory=(64 << 20) * batch, chunk=512 * batch, max_batch=max(8, batch),
                    kv_dtype="fp32")
    runner.warm_up()
    g = torch.Generator().manual_seed(0)
    rs = [Request(i, torch.randint(0, model.spec.vocab, (prompt,), generator=g).tolist(), 4 * steps + 8)
          for i in range(batch)]
    for r in rs:
        runner.add(r)
    runner.step()  # the prefills (one chunk budget holds them all)
    for _ in range(3):
        runner.step()  # the first decode steps build what they build once
    return runner, rs[0]


def forward_only(runner: Runner, r: Request):
    """The runner's forward of r's next token, without scheduling or sampling; rewrites the same slot each
    call (position r.computed), so the context stays the same."""
    from kvwall.serve.scheduler import Chunk

    def fn():
        with torch.inference_mode():
            runner.forward([Chunk(r, r.computed - 1, 1)])  # (1, V)
    return fn


def contiguous_forward(model, context: int):
    cache = make_cache("contiguous", model.spec, 1, context + 64)
    with torch.inference_mode():
        model(torch.ones(1, context, dtype=torch.long), torch.arange(context)[None], cache)

    def fn():
        with torch.inference_mode():
            model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[context]]), cache, last_only=True)  # (1, 1, V)
    return fn


def profile(runner: Runner, steps: int, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            runner.step()
    events = prof.key_averages(group_by_input_shape=True)
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    print(f"torch.profiler: {total:.1f} ms of aten self time per step (profiling adds its own); top ops per step:")
    print(f"{'op':<34} {'calls':>6} {'ms/step':>8}  input shapes")
    for e in rows:
        shapes = str(e.input_shapes)[:70]
        print(f"{e.key:<34} {e.count // steps:>6} {e.self_cpu_time_total / steps / 1e3:>8.2f}  {shapes}")
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.key] = by_name.get(e.key, 0.0) + e.self_cpu_time_total / steps / 1e3
    print("by op name (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                              sorted(by_name.items(), key=lambda kv: -kv[1])[:12]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1)")
    args = p.parse_args()
    model = load_model(gguf_file(args.model) or args.model)
    print(f"{args.model} fp32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}")
    runner, r = decoding_runner(model, args.prompt, args.steps, args.batch)
    context = r.computed
    print(f"batch-{args.batch} decode at context ~{context}, median of {args.steps} steps:")
    print(f"  runner.step (schedule + paged forward + sampling): {median_ms(runner.step, args.steps):6.1f} ms")
    print(f"  forward over the paged pool alone:                 "
          f"{median_ms(forward_only(runner, r), args.steps):6.1f} ms")
    print(f"  forward over a contiguous cache:                   "
          f"{median_ms(contiguous_forward(model, context), args.steps):6.1f} ms")
    model.set_eager(True)
    print(f"  the same, eager (no fast path):                     "
          f"{median_ms(contiguous_forward(model, context), args.steps):6.1f} ms")
    model.set_eager(False)
    profile(runner, min(args.steps, 10), args.top)


if __name__ == "__main__":
    main()
