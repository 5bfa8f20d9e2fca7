"""`kvwall simulate MODEL --device D`: a request stream served in simulated time (kvwall serve's scheduler,
roofline step times); `--find-rate` for the largest rate that meets an SLO, `--sweep` for a small grid."""

from __future__ import annotations

import argparse

from kvwall import api
from kvwall.commands import common
from kvwall.commands.speed_cmds import add_roof_args, roof_knobs
from kvwall.report.tables import console, table
from kvwall.units import fmt_bytes, real, seconds_arg, whole

SWEEPABLE = api.SWEEPABLE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="serve a request stream in simulated time: latency percentiles, "
                       "throughput, goodput (kvwall serve's scheduler, roofline step times)")
    p.add_argument("model")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--rate", type=real(0, 1e6, lo_open=True), help="Poisson arrivals, requests per second")
    how.add_argument("--concurrency", type=whole(1, 1 << 20), help="this many clients, one request at a time each")
    p.add_argument("--requests", type=whole(1, 1_000_000), default=1000, metavar="N", help="default 1000")
    p.add_argument("--prompt-tokens", default="512", metavar="L",
                   help="prompt lengths: 512, lognormal:mean=512,sd=0.5 or uniform:min=64,max=1024 (default 512)")
    p.add_argument("--output-tokens", default="128", metavar="L", help="output lengths, the same forms (default 128)")
    p.add_argument("--dataset", metavar="FILE.jsonl", help="requests from a file: {\"prompt_tokens\" or \"prompt\", "
                   "\"output_tokens\"} a line (replaces the length options)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--kv-memory", metavar="SIZE", help="KV pool per GPU, e.g. 40GB (default: what is left)")
    mem.add_argument("--reserve", metavar="SIZE|%", help="memory kept free per GPU (default 10%%)")
    p.add_argument("--shared-prefix", type=whole(0, 1 << 24), default=0, metavar="TOKENS",
                   help="every prompt begins with the same TOKENS tokens (a system prompt), put before its own "
                        "length; the prefix cache skips its full blocks (default 0)")
    p.add_argument("--chunk", type=whole(1, 1 << 20), default=512, help="token budget per step (default 512)")
    p.add_argument("--max-batch", type=whole(1, 1 << 16), default=256, help="requests running at once (default 256)")
    p.add_argument("--block-size", type=whole(1, 1 << 12), default=16, help="tokens per KV block (default 16)")
    p.add_argument("--split-prefill", action="store_true",
                   help="decode rows in one forward, prefill chunks in one per length, as kvwall serve runs them")
    p.add_argument("--seed", type=whole(0, 2**63 - 1), default=0)
    p.add_argument("--slo-ttft", type=seconds_arg, metavar="T", help="goodput: TTFT at most T, e.g. 1s")
    p.add_argument("--slo-tpot", type=seconds_arg, metavar="T", help="goodput: time per output token at most T, "
                   "e.g. 100ms")
    p.add_argument("--find-rate", action="store_true", help="the largest Poisson rate whose p90 TTFT and TPOT "
                   "meet --slo-ttft / --slo-tpot (bisection)")
    p.add_argument("--sweep", nargs="+", metavar="KEY=V1,V2",
                   help=f"a grid, e.g. tp=1,2,4,8 kv-format=bf16,fp8 (keys: {', '.join(SWEEPABLE)})")
    p.add_argument("--plot", metavar="PNG", help="latency CDFs and KV blocks over time (a sweep: a Pareto plot)")
    common.add_model_knobs(p)
    common.add_parallel(p)
    add_roof_args(p)
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_simulate)


SIMULATE_OPTIONS = ("rate", "concurrency", "requests", "prompt_tokens", "output_tokens", "dataset", "kv_memory",
                    "reserve", "shared_prefix", "chunk", "max_batch", "block_size", "split_prefill", "seed",
                    "slo_ttft", "slo_tpot", "find_rate", "sweep", "plot")


def cmd_simulate(args) -> int:
    r = api.simulate(args.model, **{k: getattr(args, k) for k in SIMULATE_OPTIONS}, **common.model_knobs(args),
                     **common.parallel_sizes(args), **roof_knobs(args),
                     progress=lambda what: _progress(args, what))
    return common.emit(args, r.to_dict(), _print)


class _progress:
    """A transient status line with simulated time and finished requests (nothing with --json)."""

    def __init__(self, args, what: str):
        self.quiet, self.what = args.json, what

    def __enter__(self):
        from rich.status import Status

        self.status = None if self.quiet else Status(self.what, console=console())
        if self.status:
            self.status.start()
        return self.tick

    def tick(self, t: float, done: int) -> None:
        if self.status and done % 50 == 0:
            self.status.update(f"{self.what} simulated {t:,.1f} s, {done:,} finished")

    def __exit__(self, *exc):
        if self.status:
            self.status.stop()


def _ms(d: dict | None, key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v * 1e3:,.1f}"


def _per_s(v) -> str:
    return "-" if v is None else f"{v:,.2f}"


def _print(data: dict) -> None:
    c = console()
    for p in data["points"]:
        load = (f"rate {p['rate']:g}/s" if p.get("rate") else f"concurrency {p.get('concurrency')}")
        if p["mode"] == "find-rate":
            load = (f"largest rate meeting the SLO at p90: {p['rate']:.3g}/s" if p["rate"]
                    else "no rate meets the SLO (not even the lowest tried)")
        pool = p["pool"]
        c.print(f"[bold]{p['model']}[/bold] on {p['device']} tp={p['tp']} pp={p['pp']}, weights "
                f"{p['formats']['weights']}, KV {p['formats']['kv']} ({p['label']}): {load}")
        c.print(f"KV pool per GPU: {fmt_bytes(pool['available_bytes'])} = {pool['n_blocks']:,} blocks of "
                f"{pool['block_size']} tokens ({fmt_bytes(pool['block_bytes'])} each); chunk {p['chunk']}, "
                f"max batch {p['max_batch']}")
        if not p.get("completed"):
            c.print("no request completed")
            continue
        rows = [[name, _ms(p[key], "mean"), _ms(p[key], "p50"), _ms(p[key], "p90"), _ms(p[key], "p99")]
                for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("e2e", "e2e_s"))]
        c.print(table("latency (ms)", ["", "mean", "p50", "p90", "p99"], rows))
        c.print(f"{p['completed']:,} requests in {p['duration_s']:,.1f} simulated s ({p['steps']:,} steps, "
                f"{p['preemptions']:,} preemptions): {_per_s(p['request_throughput'])} req/s, "
                f"{_per_s(p['output_token_throughput'])} output tok/s" + _goodput(p))
        if p.get("prefix_cached_tokens"):
            c.print(f"prefix cache: {p['prefix_cached_tokens']:,} prompt tokens taken from it, not computed")
        if "pipeline_idle" in p:
            c.print(f"pipeline: up to {p['pp']} micro-batches in flight; stages idle {p['pipeline_idle']:.0%} of the "
                    "time (the bubble, and waiting for work)")
        for note in p.get("notes", []):
            c.print(f"note: {note}")
    c.print("simulated with kvwall serve's scheduler; each step's time from the roofline of its exact mix of "
            f"prefill chunks and decode tokens, {data['points'][0]['roof']} (--json: every assumption)")
    if len(data["points"]) > 1:
        c.print(table("sweep", ["configuration", "rate", "req/s", "tok/s per GPU", "p90 TTFT ms", "p90 TPOT ms"],
                      [[p["label"], _per_s(p.get("rate")), _per_s(p.get("request_throughput")),
                        _per_s(_per_gpu(p)), _ms(p.get("ttft_s"), "p90"), _ms(p.get("tpot_s"), "p90")]
                       for p in data["points"]]))
    if data.get("plot"):
        c.print(f"plot written to {data['plot']}")


def _goodput(p: dict) -> str:
    slo = p.get("slo", {})
    if slo.get("ttft_s") is None and slo.get("tpot_s") is None:
        return ""
    return f"; goodput {_per_s(p['goodput'])} req/s under the SLO"


def _per_gpu(p: dict):
    v = p.get("output_token_throughput")
    return None if v is None else v / p["gpus"]
