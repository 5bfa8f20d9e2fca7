"""The report's serving section: the memory wall's price in a server, simulated. One request stream through
`kvwall simulate` (the scheduler `kvwall serve` runs, each step timed by the roofline) with KV pools from a few
GiB up to the working set, in three formats: how many requests the pool admits, and what that does to
throughput and time to first token. Measured serving on this machine (against vLLM and llama.cpp) is in the
README; the report never starts servers."""

from __future__ import annotations

from pathlib import Path

from kvwall.report import plots
from kvwall.report.document import Figure, Section, Table

TITLE = "Serving: the memory wall's price in lost batch"
MODEL, DEVICE = "llama-3.1-8b", "h100-sxm"
BUDGETS_GIB = (1, 2, 4, 8, 16, 32)  # 1 GiB holds 4 requests' 2,304 tokens of bf16 K/V (128 KiB a token)
FORMATS = ("bf16", "fp8", "int4")
# 2,048 tokens a step (chunked prefill), so that the pool, not the step's token budget, bounds the batch
STREAM = ["--concurrency", "128", "--requests", "128", "--prompt-tokens", "2048", "--output-tokens", "256",
          "--chunk", "2048"]


def section(out: Path) -> Section:
    from kvwall.commands.simulate_cmd import points

    rows, series = [], {}
    for fmt in FORMATS:
        for gib in BUDGETS_GIB:
            p = points([MODEL, "--device", DEVICE, *STREAM, "--kv-memory", f"{gib}GiB", "--kv-format", fmt])[0]
            running = max(t["running"] for t in p["trace"])
            rows.append([f"{gib} GiB", fmt, f"{p['pool']['n_blocks']:,}", str(running), str(p["preemptions"]),
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
        paragraphs=[f"{MODEL} on one {DEVICE} (bf16 weights, expected mode): 128 requests of 2,048 prompt + 256 output "
                    "tokens, all arriving at once, through `kvwall simulate`: the "
                    "scheduler `kvwall serve` runs (chunked prefill, admission by free KV blocks, preemption by "
                    "recompute), each step timed by the roofline for its exact mix. A smaller KV budget admits "
                    "fewer requests at once; a smaller KV format buys them back. The same sweep measured on this "
                    "machine's CPU with a real model is `benchmarks/bench_serve_memory_wall.py` (README).",
                    takeaway],
        tables=[Table(["KV budget", "format", "blocks", "most running", "preemptions", "output tok/s",
                       "TTFT p50 s", "TPOT p50 ms"], rows, "per KV budget and format")],
        figures=[Figure(fig, "output tokens/s against the KV budget (log x), one line per KV format",
                        "serving-memory-wall")],
        assumptions=["blocks of 16 tokens; 2,048 tokens a step; at most 256 running; same request lengths for every "
                     "row, no shared prefixes"])
