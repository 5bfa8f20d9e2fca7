"""The memory wall, served: throughput, admitted batch and TTFT against the KV pool's size, per pool format.

    .venv/bin/python benchmarks/bench_serve_memory_wall.py [--model smollm2-135m] [--requests 32]
        [--prompt 128] [--output 64] [--blocks 12,24,48,96,192,384] [--formats fp32,int8,int4] [--max-batch 32]
        [--weights W] [--repeats 3] [--out FILE.json] [--predict] [--table] [--plot docs/img/serve_memory_wall.png]

Offline (no HTTP): the engine `kvwall serve` runs (kvwall.serve.runner: the same scheduler, pool and
forward), with every request arriving at once; the runner steps until all finished, and a step's wall
time is charged to each token it produced. Per pool size and format it prints output tokens/s, p50/p99
TTFT (from the start to the request's first token), p50/p99 time per output token (the step times the
decoding requests saw), the largest number of requests running at once, and the preemptions.

The pool is given in fp32 blocks (--blocks); a smaller format gets the same bytes, so more blocks:
int8 (with its fp16 scale per 32 values) holds about 3.6 times the tokens of fp32, int4 about 6.4 times.
A decode step reads every pool in place (fp32 in the fused decode step; bf16, fp16, fp8 and the integer pools
through kernels/paged_decode.cpp, the integer pools inside the fused decode step too); a format written FMT/gather
(``int8/gather``) runs that pool with in-place reading off (the gather-and-dequantize path the integer pools had
before), to measure what the kernel is worth, and FMT/layers (``int8/layers``) reads it in place layer by layer
(the fused step declines it, as it did the integer pools before), to measure what the fused step is worth.
--repeats N runs every (pool, format) N times, rounds interleaved (each round runs every pair once, in order), and
keeps the median run's row (by tokens/s) with every run's tokens/s in ``tok_s_runs``.

Each row records the share of the CPUs other processes took while it ran (measure.machine.OthersWatch).
--out FILE.json keeps the measured rows and skips the (blocks, format) pairs it already holds, except rows
measured while others took more than --redo-busy of the machine, so a sweep can be split over several
runs (each under `flock /work/bench.lock timeout 600`); --plot draws what the file holds (tokens/s and
admitted batch against the KV budget, one line per format), --table prints it as the README's table.
--predict adds to every row what kvwall's predictor says for the same run (`kvwall simulate --device local`
after `kvwall calibrate`), which --plot and --table then show (dashed; the table with its error).
Timings belong on a quiet machine; the numbers move with load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvwall.measure import machine


def model_path(name: str):
    from kvwall.spec.gguf_meta import gguf_file

    return gguf_file(name) or name


def reading(runner, path: str) -> None:
    """How the runner's pool is read at a decode step, by the format's /PATH: "" in place inside the fused decode
    step (where the model has one), "layers" in place but layer by layer (the step declines the pool), "gather" the
    gather and dequantize."""
    if path not in ("", "layers", "gather"):
        raise SystemExit(f"--formats: {path!r} after the '/' is not layers or gather")
    runner.cache.in_place = path != "gather"
    if path == "layers":
        runner.cache.decode_blocks = lambda batch: None  # the fused step gets no view: every layer on its own


def run(model, kv_memory: int, fmt: str, args) -> dict:
    import torch

    from kvwall.serve.runner import Runner
    from kvwall.serve.scheduler import Request

    kv, _, path = fmt.partition("/")
    runner = Runner(model, kv_memory=kv_memory, block_size=16, chunk=args.chunk, max_batch=args.max_batch,
                    kv_dtype=kv)
    reading(runner, path)
    runner.warm_up()
    watch = machine.OthersWatch()
    g = torch.Generator().manual_seed(0)
    for i in range(args.requests):
        prompt = torch.randint(0, model.spec.vocab, (args.prompt,), generator=g).tolist()
        runner.add(Request(i, prompt, args.output))  # no stop tokens: every request runs to --output
    per_token, first, widest, t0 = [], {}, 0, time.perf_counter()
    while runner.sched.has_work():
        s0 = time.perf_counter()
        step, _ = runner.step()
        now = time.perf_counter()
        per_token += [now - s0] * len(step.sampled)
        for r in step.sampled:
            first.setdefault(r.id, now - t0)
        widest = max(widest, len(runner.sched.running))
    wall = time.perf_counter() - t0
    ttft = list(first.values())
    return {"format": fmt, "blocks": runner.sched.pool.n_blocks, "kv_bytes": kv_memory,
            "tok_s": runner.generated / wall, "wall_s": wall,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": float(np.percentile(per_token, 50) * 1e3),
            "tpot_p99_ms": float(np.percentile(per_token, 99) * 1e3), "batch": widest,
            "preemptions": runner.sched.preemptions, "others_share": watch.share(machine.cpu_count())}


def predicted(setup: dict, r: dict) -> dict:
    """What kvwall's predictor says for row r's run: `kvwall simulate --device local` (the `kvwall calibrate`
    profile) over the same requests (all arriving at once: as many clients as requests), pool bytes and format,
    chunk, batch limit and split forwards (the runner's), fp32 weights and compute. On `local` the ideal and
    expected modes are one figure (both time each op at the rates calibrate measured, with its measured fixed
    costs; measured 2026-12-02: equal in all 15 rows), so only the default mode runs. `setup`: the options the
    rows were measured with (the file's)."""
    argv = [sys.executable, "-m", "kvwall", "simulate", setup["model"], "--device", "local", "--concurrency",
            str(setup["requests"]), "--requests", str(setup["requests"]), "--prompt-tokens", str(setup["prompt"]),
            "--output-tokens", str(setup["output"]), "--kv-memory", str(r["kv_bytes"]), "--kv-format", r["format"],
            "--weight-format", "fp32", "--compute-dtype", "fp32", "--chunk", str(setup["chunk"]), "--max-batch",
            str(setup["max_batch"]), "--split-prefill", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"kvwall simulate failed: {done.stderr.strip()}")
    point = json.loads(done.stdout)["points"][0]
    if point["pool"]["n_blocks"] != r["blocks"]:  # the predictor's pool must be the runner's
        raise SystemExit(f"simulate's pool has {point['pool']['n_blocks']} blocks, the runner had {r['blocks']}")
    return {"predicted_tok_s": point["output_token_throughput"]}


def load_rows(path: Path | None) -> list[dict]:
    return json.loads(path.read_text())["rows"] if path and path.exists() else []


def save_rows(path: Path, rows: list[dict], setup: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))


def print_row(r: dict) -> None:
    print(f"{r['fp32_blocks']:>11} {r['kv_bytes'] / 2**20:>7.1f} {r['format']:>6} {r['blocks']:>6} "
          f"{r['tok_s']:>7.1f} {r['ttft_p50_s']:>8.2f}s {r['ttft_p99_s']:>8.2f}s {r['tpot_p50_ms']:>8.0f}m "
          f"{r['tpot_p99_ms']:>8.0f}m {r['batch']:>5} {r['preemptions']:>7} {r['others_share']:>6.0%}", flush=True)


HEADER = (f"{'fp32 blocks':>11} {'KV MiB':>7} {'format':>6} {'blocks':>6} {'tok/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'batch':>5} {'preempt':>7} {'others':>6}")


def markdown(rows: list[dict]) -> None:
    """The rows as the README's table, by budget then format (with the predictor's columns once --predict ran)."""
    pred = all("predicted_tok_s" in r for r in rows)
    extra = " predicted tok/s |" if pred else ""
    print("| KV budget | format | blocks | most running | preemptions | output tok/s |" + extra + " TTFT p50 s | "
          "TTFT p99 s | TPOT p50 ms | TPOT p99 ms | others' CPU |")
    print("|---" * (12 if pred else 11) + "|")
    order = {f: i for i, f in enumerate(dict.fromkeys(r["format"] for r in rows))}
    for r in sorted(rows, key=lambda r: (r["kv_bytes"], order[r["format"]])):
        p = f" {r['predicted_tok_s']:.1f} ({r['predicted_tok_s'] / r['tok_s'] - 1:+.0%}) |" if pred else ""
        print(f"| {r['kv_bytes'] / 2**20:.1f} MiB | {r['format']} | {r['blocks']:,} | {r['batch']} | "
              f"{r['preemptions']} | {r['tok_s']:.1f} |{p} {r['ttft_p50_s']:.1f} | {r['ttft_p99_s']:.1f} | "
              f"{r['tpot_p50_ms']:,.0f} | {r['tpot_p99_ms']:,.0f} | {r['others_share']:.0%} |")


def plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, c, b) = plt.subplots(1, 3, figsize=(15, 4.2))
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = sorted((r for r in rows if r["format"] == fmt), key=lambda r: r["kv_bytes"])
        mib = [r["kv_bytes"] / 2**20 for r in mine]
        line, = a.plot(mib, [r["tok_s"] for r in mine], marker="o", label=fmt)
        if all("predicted_tok_s" in r for r in mine):
            a.plot(mib, [r["predicted_tok_s"] for r in mine], ls="--", color=line.get_color(), alpha=0.7,
                   label=f"{fmt} predicted")
        b.plot(mib, [r["batch"] for r in mine], marker="o", label=fmt)
        c.plot(mib, [r["tpot_p99_ms"] for r in mine], marker="o", label=fmt)
        for r, x in zip(mine, mib):
            if r["preemptions"]:
                a.annotate(str(r["preemptions"]), (x, r["tok_s"]), textcoords="offset points", xytext=(4, -10),
                           fontsize=7, color="gray")
    for ax, what in ((a, "output tokens/s"), (c, "p99 time per output token (ms)"),
                     (b, "most requests running at once")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV memory budget (MiB)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(title="KV format")
    a.set_title("throughput (gray: preemptions; dashed: kvwall simulate)")
    b.set_title("admitted batch")
    c.set_title("p99 TPOT (a step that carries a prefill chunk)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--blocks", default="12,24,48,96,192,384", help="pool sizes in fp32 blocks of 16 tokens")
    p.add_argument("--formats", default="fp32,int8,int4", help="pool formats (serve --cache names)")
    p.add_argument("--weights", help="engine weights (serve --weights), e.g. native; default fp32")
    p.add_argument("--threads", type=int)
    p.add_argument("--repeats", type=int, default=1, help="runs of each (pool, format), interleaved; the median kept")
    p.add_argument("--out", type=Path, help="JSON file of rows: read, skipped if present, added to")
    p.add_argument("--plot", type=Path, help="draw the rows of --out to this PNG (no measuring)")
    p.add_argument("--predict", action="store_true",
                   help="add the predictor's figure to every row of --out (kvwall simulate --device local; "
                        "run kvwall calibrate first) and draw it in --plot (no measuring)")
    p.add_argument("--table", action="store_true", help="print the rows of --out as a markdown table (no measuring)")
    p.add_argument("--decode-steps", type=Path, metavar="FILE.json",
                   help="time decode steps alone instead of serving: at context --prompt, each pool's largest batch "
                        "(up to --max-batch) over random K/V, --repeats interleaved; rows to FILE.json")
    p.add_argument("--redo-busy", type=float, default=0.10, metavar="SHARE",
                   help="measure again the rows of --out during which other processes took more than this share "
                        "of the CPUs (or that did not record it); default 0.10")
    return p.parse_args()


def main() -> None:
    args = parse()
    rows = load_rows(args.out)
    if args.table:
        markdown(rows)
        return
    if args.predict:
        if not rows:
            raise SystemExit("--predict adds to the rows of --out FILE.json; measure some first")
        setup = json.loads(args.out.read_text())["setup"]
        if setup.get("weights"):
            raise SystemExit("--predict models fp32 weights; these rows ran --weights " + setup["weights"])
        for r in rows:
            r.update(predicted(setup, r))
            print(f"{r['kv_bytes'] / 2**20:7.1f} MiB {r['format']:>5}: measured {r['tok_s']:.1f}, predicted "
                  f"{r['predicted_tok_s']:.1f} output tokens/s", flush=True)
        save_rows(args.out, rows, dict(setup, predicted=f"kvwall simulate --device local, {time.strftime('%F')}"))
        return
    if args.plot:
        made = json.loads(args.out.read_text())["setup"] if args.out and args.out.exists() else vars(args)
        plot(rows, args.plot, f"{made['model']}: {made['requests']} requests of {made['prompt']}+{made['output']} "
                              f"tokens, all at once, max batch {made['max_batch']}")
        return
    import torch

    from kvwall.engine.load import load_model
    from kvwall.serve.runner import block_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(model_path(args.model), weights=args.weights)
    fp32_block = block_bytes(model.spec, 16, torch.float32)
    if args.decode_steps:
        decode_steps(model, fp32_block, args)
        return
    need = -(-(args.prompt + args.output) // 16)
    print(f"{args.model}: {fp32_block} B per fp32 block of 16 tokens; one request needs {need} blocks, "
          f"all {args.requests} need {need * args.requests}; torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(HEADER)
    rows = [r for r in rows if r.get("others_share", 1.0) <= args.redo_busy]
    done = {(r["fp32_blocks"], r["format"]) for r in rows}
    todo = [(n, fmt) for n in [int(x) for x in args.blocks.split(",")] for fmt in args.formats.split(",")
            if n >= need and (n, fmt) not in done]  # one request must fit (the server refuses it otherwise)
    runs: dict[tuple[int, str], list[dict]] = {pair: [] for pair in todo}
    for _ in range(args.repeats):  # rounds: every pair once a round, so a slow spell of the machine hits them all
        for n, fmt in todo:
            r = {"fp32_blocks": n, **run(model, n * fp32_block, fmt, args)}
            print_row(r)
            runs[(n, fmt)].append(r)
        if args.out:  # after every round: the medians so far (a sweep cut short keeps its finished rounds)
            save_rows(args.out, rows + medians(runs), {k: v for k, v in vars(args).items() if k not in ("out", "plot")})
    if args.repeats > 1:
        print(f"median of {args.repeats}")
        for r in medians(runs):
            print_row(r)


def decode_steps(model, fp32_block: int, args) -> None:
    """The decode step alone, where the wall is: every row holds --prompt tokens (random K/V; the kernels' time does
    not depend on the values) and adds one; each pool runs the largest batch its budget holds (up to --max-batch).
    Output tokens/s = batch / step time: what serving reaches once prefill is done. Median of --repeats rounds,
    each round every (budget, format) once, after one untimed step each."""
    import torch

    from kvwall.serve.runner import QuantizedPages, Runner

    need = -(-(args.prompt + 1) // 16)
    setups = []
    for n in [int(x) for x in args.blocks.split(",")]:
        for fmt in args.formats.split(","):
            kv, _, path = fmt.partition("/")
            runner = Runner(model, kv_memory=n * fp32_block, block_size=16, max_batch=args.max_batch, kv_dtype=kv)
            reading(runner, path)
            batch = min(args.max_batch, runner.sched.pool.n_blocks // need)
            if batch == 0:
                continue
            g = torch.Generator().manual_seed(0)
            packed = isinstance(runner.cache, QuantizedPages)  # pools of (group, [codes, scales, zeros]) pairs
            for pair in filter(None, runner.cache.pools):
                for part in (p for _, parts in pair for p in parts) if packed else pair:
                    if part.dtype == torch.uint8:  # codes
                        part.copy_(torch.randint(0, 256, part.shape, generator=g, dtype=torch.uint8))
                    elif part.dtype == torch.float16 and packed:  # scales, zero points
                        part.copy_(torch.rand(part.shape, generator=g).half() * 0.02)
                    else:
                        part.copy_(torch.randn(part.shape, generator=g).to(part.dtype))
            setups.append((n, fmt, runner, batch, []))
    print(f"{'fp32 blocks':>11} {'format':>12} {'context':>7} {'batch':>5} {'step ms':>8} {'tok/s':>7} {'others':>6}")

    @torch.inference_mode()
    def step(runner, batch) -> float:
        runner.cache.plan([list(range(b * need, (b + 1) * need)) for b in range(batch)], [args.prompt + 1] * batch)
        tokens, pos = torch.zeros(batch, 1, dtype=torch.long), torch.full((batch, 1), args.prompt)
        t0 = time.perf_counter()
        runner.model(tokens, pos, runner.cache, last_only=True)
        return time.perf_counter() - t0

    for _, _, runner, batch, _ in setups:
        step(runner, batch)  # untimed: first-use kernel builds, allocations
    rows = []
    for _ in range(args.repeats):
        for _n, _fmt, runner, batch, times in setups:
            watch = machine.OthersWatch()
            times.append((step(runner, batch), watch.share(machine.cpu_count())))
    for n, fmt, runner, batch, times in setups:
        s, share = sorted(times)[(len(times) - 1) // 2]
        rows.append({"fp32_blocks": n, "kv_bytes": n * fp32_block, "format": fmt, "blocks": runner.sched.pool.n_blocks,
                     "context": args.prompt, "batch": batch, "step_ms": s * 1e3, "tok_s": batch / s,
                     "step_ms_runs": [t * 1e3 for t, _ in times], "others_share": max(o for _, o in times)})
        r = rows[-1]
        print(f"{n:>11} {fmt:>12} {args.prompt:>7} {batch:>5} {r['step_ms']:>8.1f} {r['tok_s']:>7.1f} "
              f"{r['others_share']:>6.0%}", flush=True)
    old = json.loads(args.decode_steps.read_text())["rows"] if args.decode_steps.exists() else []
    setup = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    save_rows(args.decode_steps, old + rows, dict(setup, mode="decode steps", date=time.strftime("%F %H:%M UTC",
                                                                                                  time.gmtime())))


def medians(runs: dict[tuple[int, str], list[dict]]) -> list[dict]:
    """Per (pool, format): its median run by tokens/s (the lower middle of an even count), with every run's tokens/s
    and the largest share of the CPUs others took in any of them."""
    out = []
    for mine in filter(None, runs.values()):
        mid = sorted(mine, key=lambda r: r["tok_s"])[(len(mine) - 1) // 2]
        out.append(dict(mid, tok_s_runs=[m["tok_s"] for m in mine], others_share=max(m["others_share"] for m in mine)))
    return out


if __name__ == "__main__":
    main()
