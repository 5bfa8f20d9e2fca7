"""The report's serving section: the memory wall's price in a server, simulated. One request stream through
`kvwall simulate` (the scheduler `kvwall serve` runs, each step timed by the roofline) with KV pools from a few
GiB up to the working set, in three formats: how many requests the pool admits, and what that does to
throughput and time to first token. Measured serving on this machine (against vLLM and llama.cpp) is in the
README; the report never starts servers."""

from __future__ import annotations

from pathlib import Path

from kvwall.predict.devices import get_device
from kvwall.predict.expected import expected_roof
from kvwall.predict.memory import Formats, Parallel
from kvwall.predict.roofline import default_compute_dtype
from kvwall.report import plots
from kvwall.report.analysis import fit_provenance
from kvwall.report.document import Figure, Section, Table
from kvwall.spec.resolve import load_spec

TITLE = "Serving: the memory wall's price in lost batch"
MODEL, DEVICE = "llama-3.1-8b", "h100-sxm"
BUDGETS_GIB = (1, 2, 4, 8, 16, 32)  # 1 GiB holds 4 requests' 2,304 tokens of bf16 K/V (128 KiB a token)
FORMATS = ("bf16", "fp8", "int4")
REQUESTS, PROMPT, OUTPUT = 128, 2048, 256  # all arriving at once
CHUNK = 2048  # tokens a step (chunked prefill), so that the pool, not the step's token budget, bounds the batch
MAX_BATCH = 256
BLOCK = 16  # tokens a KV block holds (kvwall serve's default)


def _run(fmt: str, gib: int) -> dict:
    """What `kvwall simulate MODEL --device DEVICE --concurrency 128 --requests 128 --prompt-tokens 2048
    --output-tokens 256 --chunk 2048 --kv-memory {gib}GiB --kv-format {fmt}` reports (its summary and trace), with
    the pool's block count and the stream it ran: its (prompt, output) lengths, and whether all arrived at 0."""
    from kvwall import simulate as sim, workload

    spec = load_spec(MODEL)
    fm = Formats.for_spec(spec, kv=fmt)
    device, par = get_device(DEVICE), Parallel()
    roof = expected_roof(device, default_compute_dtype(fm), fm, spec, par.tp)
    pool = sim.kv_pool(spec, fm, par, device.memory_bytes, 0, BLOCK, MAX_BATCH, gib << 30)
    requests = workload.stream(REQUESTS, workload.Lengths("fixed", PROMPT), workload.Lengths("fixed", OUTPUT))
    run = sim.simulate(requests, sim.StepClock(spec, fm, roof, par, BLOCK), pool, CHUNK, MAX_BATCH,
                       concurrency=REQUESTS)
    return {**sim.report(run), "n_blocks": pool.n_blocks, "all_at_once": all(r.arrival_s == 0 for r in requests),
            "lengths": sorted({(r.prompt_tokens, r.output_tokens) for r in requests})}


def _stream_words(p: dict) -> str:
    """The simulated stream in words, from what the simulation ran: "128 requests of 2,048 prompt + 256 output
    tokens, all arriving at once"."""
    lengths = " or ".join(f"{a:,} prompt + {b:,} output" for a, b in p["lengths"])
    return f"{p['requests']:,} requests of {lengths} tokens" + (", all arriving at once" if p["all_at_once"] else "")


def section(out: Path) -> Section:
    rows, series, stream = [], {}, None
    for fmt in FORMATS:
        for gib in BUDGETS_GIB:
            p = _run(fmt, gib)
            stream = stream or _stream_words(p)
            running = max(t["running"] for t in p["trace"])
            rows.append([f"{gib} GiB", fmt, f"{p['n_blocks']:,}", str(running), str(p["preemptions"]),
                         f"{p['output_token_throughput']:,.0f}", f"{p['ttft_s']['p50']:,.1f}",
                         f"{p['tpot_s']['p50'] * 1e3:,.1f}"])
            series.setdefault(fmt, []).append((gib, p["output_token_throughput"]))
    lo, hi, small = series["bf16"][0], series["bf16"][-1], FORMATS[-1]
    beats = next((g for g, t in series[small] if t >= hi[1]), None)
    takeaway = (f"In bf16, {lo[0]} GiB of KV serves {lo[1]:,.0f} output tokens/s and {hi[0]} GiB {hi[1]:,.0f}"
                + (f"; {small} passes that from {beats} GiB." if beats else "."))
    fig = plots.lines(series, "KV memory budget (GiB)", "output tokens/s", f"{MODEL} on one {DEVICE}: throughput "
                      "against the KV budget, per KV format (simulated)", out / "serving-memory-wall.png", logx=True)
    return Section(
        TITLE,
        paragraphs=[f"{MODEL} on one {DEVICE} (bf16 weights, expected mode): {stream}, through `kvwall simulate`: the "
                    "scheduler `kvwall serve` runs (chunked prefill, admission by free KV blocks, preemption by "
                    "recompute), each step timed by the roofline for its exact mix. A smaller KV budget admits "
                    "fewer requests at once; a smaller KV format buys them back. The same sweep measured on this "
                    "machine's CPU with a real model is `benchmarks/bench_serve_memory_wall.py` (README).",
                    takeaway],
        tables=[Table(["KV budget", "format", "blocks", "most running", "preemptions", "output tok/s",
                       "TTFT p50 s", "TPOT p50 ms"], rows, "per KV budget and format")],
        figures=[Figure(fig, "output tokens/s against the KV budget (log x), one line per KV format",
                        "serving-memory-wall")],
        assumptions=[f"blocks of {BLOCK} tokens; {CHUNK:,} tokens a step; at most {MAX_BATCH:,} running; same request "
                     "lengths for every row, no shared prefixes"],
        provenance=f"simulated in this run (no server was run); {fit_provenance()}")
