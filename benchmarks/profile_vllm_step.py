"""kvwall's decode step against vLLM's CPU build, both timed end to end over the same window.

    .venv/bin/python benchmarks/profile_vllm_step.py CHECKPOINT --vllm-python /work/venvs/vllm/bin/python
        [--engines kvwall,vllm] [--batch 1,16] [--prompt 16] [--steps 64] [--threads 2] [--runs 3]
        [--json benchmarks/results/step_peers_DATE.json]

CHECKPOINT: the fp32 Hugging Face export bench_serve_peers.py writes (~/.cache/kvwall/peers/*-fp32); both engines
load it. The window (the results' "window" field) is each engine's own offline generate call, what a user of its
API gets: kvwall's `kvwall.engine.generate.generate` (its prefill, decode loop and sampler), vLLM's
`LLM.generate` (scheduler, model runner, sampler, output processing). Each is given the same B random
`--prompt`-token prompts (token ids, fixed seed) and generates greedily with EOS ignored, token ids out (vLLM
with detokenize off: kvwall's generate returns ids), once to 1 token (the prefill) and once to `--steps` + 1;
(second - first) / steps is its decode step at batch B, context prompt .. prompt + steps. Until 2026-12 this
script timed vLLM so while kvwall was timed as a bare forward plus argmax (profile_decode.py): unequal work.

Each engine runs in its own long-lived worker process (this file with --worker; vLLM's in its own venv, where it
imports nothing of kvwall), loaded once, on `--threads` compute threads (benchmarks/fair.py: kvwall
torch.set_num_threads, vLLM VLLM_CPU_OMP_THREADS_BIND=0-(N-1)). vLLM runs as its offline API does by default
(its engine core in a child process); prefix caching is off so the repeats recompute, max_num_seqs 32, KV space
VLLM_CPU_KVCACHE_SPACE (GiB, 1 unless set). Per batch both warm up once, then `--runs` rounds, the engines taking
turns (fair.turns); the file keeps every run and each engine's median. Run it on a quiet machine, under the
bench lock.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fair  # no kvwall import: loads in vLLM's venv too

TAG = "@@ "  # a worker's answers start with it; every other line it prints is log (vLLM logs to stdout)
WINDOW = ("each engine's own offline generate call, token ids in and out, greedy, EOS ignored: "
          "(time to steps + 1 tokens - time to 1 token) / steps")


# -- the workers: one engine each, loaded once, answering one generate call per request line ---------------

class KvwallWorker:
    name = "kvwall"

    def __init__(self, checkpoint: str, threads: int):
        import torch

        from kvwall.engine.load import load_model

        torch.set_num_threads(threads)
        self.torch, self.model = torch, load_model(checkpoint)
        self.threads_reported = torch.get_num_threads()
        self.reported_by = "torch.get_num_threads() in the worker"

    def version(self) -> str:
        out = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "unknown"

    def generate(self, prompts: list[list[int]], tokens: int) -> None:
        from kvwall.engine.generate import generate

        generate(self.model, prompts, max_new_tokens=tokens, stop=())  # stop=(): EOS ignored, every row runs on


class VllmWorker:
    name = "vllm"

    def __init__(self, checkpoint: str, threads: int):
        from vllm import LLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.llm = LLM(checkpoint, dtype="float32", max_model_len=2048, max_num_seqs=32, enable_prefix_caching=False)
        self.threads_reported = None  # its log says: the driver counts the threads it bound
        self.reported_by = None

    def version(self) -> str:
        import vllm

        return vllm.__version__

    def generate(self, prompts: list[list[int]], tokens: int) -> None:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, ignore_eos=True,
                                detokenize=False)
        self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def worker(engine: str, checkpoint: str, threads: int) -> None:
    """Load the engine, say so, then per request line {"prompts", "tokens"} answer {"s": seconds of generate}."""
    w = (KvwallWorker if engine == "kvwall" else VllmWorker)(checkpoint, threads)
    answer({"ready": True, "version": w.version(), "threads_reported": w.threads_reported,
            "threads_reported_by": w.reported_by})
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        w.generate(job["prompts"], job["tokens"])
        answer({"s": time.perf_counter() - t0})


def answer(d: dict) -> None:
    print(TAG + json.dumps(d), flush=True)


# -- the driver ------------------------------------------------------------------------------------------

class Engine:
    """A worker process seen from the driver; its log lines go to `log`."""

    def __init__(self, key: str, python: str, checkpoint: str, threads: int, log: Path):
        env = {**os.environ, **(fair.vllm_env(threads) if key == "vllm" else fair.torch_env(threads))}
        self.key, self.log_path, self.threads = key, log, threads
        self.setting = {k: v for k, v in env.items() if k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}
        self.log = log.open("w")
        self.proc = subprocess.Popen([python, __file__, checkpoint, "--worker", key, "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.ready = self._read()
        self.log.flush()
        if key == "vllm":
            self.ready["threads_reported"] = fair.vllm_bound_threads(log.read_text(errors="replace"))
            self.ready["threads_reported_by"] = "vLLM's log: OpenMP threads bound"

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
            self.log.write(line)
        raise SystemExit(f"the {self.key} worker exited ({self.proc.wait()}); see {self.log_path}")

    def generate_s(self, prompts: list[list[int]], tokens: int) -> float:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()["s"]

    def step_s(self, prompts: list[list[int]], steps: int) -> tuple[float, float, float]:
        """(decode step, seconds to 1 token, seconds to steps + 1 tokens)."""
        one, many = self.generate_s(prompts, 1), self.generate_s(prompts, steps + 1)
        return (many - one) / steps, one, many

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def medians(rows: list[dict]) -> list[dict]:
    """Per engine and batch: the median step over its runs."""
    out = []
    for key in dict.fromkeys((r["engine"], r["batch"]) for r in rows):
        runs = [r for r in rows if (r["engine"], r["batch"]) == key]
        step = fair.median([r["step_s"] for r in runs])
        out.append({"engine": key[0], "batch": key[1], "threads": runs[0]["threads"],
                    "threads_reported": runs[0]["threads_reported"], "runs": len(runs), "step_s": step,
                    "tok_s": key[1] / step})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--worker", choices=["kvwall", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu")
    p.add_argument("--engines", default="kvwall,vllm")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=fair.THREADS,
                   help=f"compute threads of every engine (default {fair.THREADS}: this machine's cores)")
    p.add_argument("--runs", type=int, default=3, help="rounds, the engines taking turns (default 3)")
    p.add_argument("--json", metavar="PATH", help="write every run and the medians here")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.checkpoint, args.threads)
    pythons = {"kvwall": sys.executable, "vllm": args.vllm_python}
    keys = args.engines.split(",")
    if "vllm" in keys and not args.vllm_python:
        raise SystemExit("--engines vllm needs --vllm-python")
    vocab = json.loads((Path(args.checkpoint) / "config.json").read_text())["vocab_size"]
    logs = Path(tempfile.gettempdir()) / "profile_vllm_step"  # the workers' logs (vLLM's: its thread binding)
    logs.mkdir(parents=True, exist_ok=True)
    engines = {k: Engine(k, pythons[k], args.checkpoint, args.threads, logs / f"{k}.log") for k in keys}
    rows, rng = [], random.Random(0)
    try:
        for e in engines.values():
            r = e.ready
            print(f"{e.key} {r['version']}: {e.threads} threads given ({e.setting}), "
                  f"{r['threads_reported']} reported ({r['threads_reported_by']})", flush=True)
        for b in (int(x) for x in args.batch.split(",")):
            prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(b)]
            for e in engines.values():
                e.generate_s(prompts, 2)  # warm-up: this batch's shapes
            for run, key in fair.turns(keys, args.runs):
                e = engines[key]
                step, one, many = e.step_s(prompts, args.steps)
                rows.append({"engine": key, "version": e.ready["version"], "batch": b, "run": run,
                             "threads": e.threads, "thread_setting": e.setting,
                             "threads_reported": e.ready["threads_reported"],
                             "threads_reported_by": e.ready["threads_reported_by"], "step_s": step,
                             "to_1_token_s": one, f"to_{args.steps + 1}_tokens_s": many,
                             "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
                print(f"batch {b} run {run} {key}: decode step {step * 1e3:.1f} ms", flush=True)
    finally:
        for e in engines.values():
            e.close()
    meds = medians(rows)
    for m in meds:
        print(f"batch {m['batch']} {m['engine']}: median step {m['step_s'] * 1e3:.1f} ms ({m['tok_s']:.1f} tok/s) "
              f"over {m['runs']} runs on {m['threads']} threads")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "window": WINDOW, "checkpoint": args.checkpoint, "prompt": args.prompt, "steps": args.steps,
            "threads": args.threads, "runs": rows, "medians": meds}, indent=1))


if __name__ == "__main__":
    main()
