"""Where a lone request's TTFT goes: the same prompt's prefill three ways, beside what the simulator charges.

    KVWALL_HOME=... .venv/bin/python benchmarks/profile_ttft.py [--model smollm2-135m] [--prompt 128 | 4096] [--runs 9]
        [--weights fp32 | native | native+a8] [--profile]

Run after `kvwall calibrate`, on a quiet machine. Times (median of --runs, after 2 warm-up ones):

* the model's plain prefill of a --prompt-token prompt over a contiguous cache (last position's logits only);
* the serving runner's prefill of one such request over an fp32 paged pool (kvwall.serve.runner): its steps
  from the request's arrival to its first token, one chunk of 512 prompt tokens a step;
* TTFT through the real server stack (uvicorn and the engine thread in this process, a client process sending
  token ids and timing the first streamed token, one request at a time);

and, for fp32 weights on the `local` profile, the simulator's forward for that step (StepClock: the op model plus
the paged pool) and what it adds for the serving stack (Device.runner_time). The simulator's TTFT at light load is
the sum of the last two; the first three say which part of the gap is the op model and which the server.
--profile: also one plain prefill under torch.profiler, its top ops' self time (attention against matmuls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from kvwall.engine.caches import make_cache
from kvwall.engine.load import load_model
from kvwall.serve.runner import Runner, block_bytes
from kvwall.serve.scheduler import Request
from kvwall.spec.gguf_meta import gguf_file

WARM = 2  # runs before the timed ones
CHUNK, BLOCK = 512, 16  # kvwall serve's prefill chunk and KV block (tokens)

_CLIENT = r"""
import http.client, json, random, sys, time
port, n, p, vocab = map(int, sys.argv[1:5])
rng, out = random.Random(0), []
for i in range(n):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"model": "m", "prompt": [rng.randrange(1, vocab) for _ in range(p)], "max_tokens": 2,
                       "stream": True, "ignore_eos": True})
    t0, first = time.perf_counter(), None
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    for line in c.getresponse():
        if line.startswith(b"data: {") and first is None:
            first = time.perf_counter() - t0
    out.append(first)
    time.sleep(0.3)  # the server idles between requests, as at light load
print(json.dumps(out))
"""


def _median_ms(times: list[float]) -> float:
    return statistics.median(times[WARM:]) * 1e3


@torch.inference_mode()
def prefill_once(model, prompt: int) -> float:
    """Seconds of one plain prefill: a random prompt over a fresh contiguous cache, the last position's logits."""
    cache = make_cache("contiguous", model.spec, 1, prompt + 64)
    ids = torch.randint(0, model.spec.vocab, (1, prompt))  # (1, T)
    t0 = time.perf_counter()
    model(ids, torch.arange(prompt)[None], cache, last_only=True)  # (1, 1, V)
    return time.perf_counter() - t0


def plain_prefill(model, prompt: int, runs: int) -> list[float]:
    return [prefill_once(model, prompt) for _ in range(runs + WARM)]


def profile_plain(model, prompt: int, rows: int = 6) -> str:
    """torch.profiler's self time per aten op over one plain prefill (after one untimed): which part of a long
    prefill is attention and which the matmuls. kvwall's own kernels (packed weights) are not aten ops: they
    show only in the total's shortfall from the wall time."""
    prefill_once(model, prompt)
    with torch.profiler.profile() as prof:
        wall = prefill_once(model, prompt)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    return (f"  one profiled plain prefill: {wall * 1e3:.0f} ms wall; self time per op: "
            + ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.0f} ms" for e in ops))


def _runner(model, prompt: int) -> Runner:
    """chunk 512 and an fp32 pool, as kvwall serve's defaults; 64 MiB of blocks, or a prompt's worth and a
    margin where a long prompt needs more (one request runs at a time)."""
    blocks = max((64 << 20) // block_bytes(model.spec, BLOCK, "fp32"), -(-(prompt + 64) // BLOCK) + 1)
    runner = Runner(model, n_blocks=blocks, block_size=BLOCK, chunk=CHUNK, max_batch=8, kv_dtype="fp32")
    runner.warm_up()
    return runner


def runner_prefill(model, prompt: int, runs: int) -> list[float]:
    """The runner's steps from a request's arrival to its first token: one step up to CHUNK prompt tokens,
    ceil(prompt / CHUNK) steps past that, each chunk attending to the blocks the earlier ones wrote."""
    runner, times = _runner(model, prompt), []
    for i in range(runs + WARM):
        r = Request(i, torch.randint(0, model.spec.vocab, (prompt,)).tolist(), 1)
        runner.add(r)
        t0 = time.perf_counter()
        while not r.out:
            runner.step()  # a chunk of the prefill; the last one samples the first token
        times.append(time.perf_counter() - t0)
        while runner.sched.has_work():
            runner.step()
    return times


def served_ttft(model, prompt: int, runs: int) -> list[float]:
    from kvwall.serve import serving_in_thread
    from kvwall.serve.server import Api
    from kvwall.serve.worker import Worker

    with serving_in_thread(Api(Worker(_runner(model, prompt)), None, "m").app()) as url:
        port = url.rsplit(":", 1)[1]
        out = subprocess.run([sys.executable, "-c", _CLIENT, port, str(runs + WARM), str(prompt),
                              str(model.spec.vocab)], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout)


def simulated(model_name: str, prompt: int) -> tuple[float, float]:
    """(forward, serving stack) seconds the simulator charges a lone prefill step on the `local` profile."""
    from kvwall.predict.devices import get_device
    from kvwall.predict.memory import Formats
    from kvwall.predict.roofline import Roof
    from kvwall.simulate import StepClock
    from kvwall.spec.resolve import load_spec

    spec = load_spec(model_name)
    clock = StepClock(spec, Formats.for_spec(spec, "fp32", "fp32"), Roof(get_device("local"), "fp32"))
    forward = clock.time([(0, prompt)])
    return forward, clock.runner_time([(0, prompt)], forward)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--weights", default="fp32", help="the model's weights (kvwall's --weights; default fp32)")
    p.add_argument("--profile", action="store_true", help="also one plain prefill under torch.profiler: the top "
                   "ops' self time")
    args = p.parse_args()
    model = load_model(gguf_file(args.model) or args.model, weights=None if args.weights == "fp32" else args.weights)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {args.model} {args.weights}, "
          f"{args.prompt}-token prompt, "
          f"median of {args.runs}; load average {os.getloadavg()[0]:.2f}")
    for name, times in (("plain prefill (contiguous cache)", plain_prefill(model, args.prompt, args.runs)),
                        ("runner's prefill (paged pool)", runner_prefill(model, args.prompt, args.runs)),
                        ("served TTFT (client process)", served_ttft(model, args.prompt, args.runs))):
        print(f"  {name:34s} {_median_ms(times):7.1f} ms   runs {[round(t * 1e3) for t in times]}")
    if args.profile:
        print(profile_plain(model, args.prompt))
    if args.weights == "fp32":  # simulated() charges fp32 weights
        forward, stack = simulated(args.model, args.prompt)
        print(f"  simulated: forward {forward * 1e3:.1f} ms + serving stack {stack * 1e3:.1f} ms = "
              f"{(forward + stack) * 1e3:.1f} ms; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
