"""`kvwall simulate MODEL --device D`: a request stream served in simulated time (kvwall serve's scheduler,
roofline step times); `--find-rate` for the largest rate that meets an SLO, `--sweep` for a small grid."""

from __future__ import annotations

import argparse
import copy
import itertools

from kvwall.commands import common
from kvwall.commands.speed_cmds import add_roof_args, roof_from
from kvwall.errors import KvwallError
from kvwall.files import PLOT_EXTS, check_output
from kvwall.predict.expected import describe
from kvwall.predict.fit import parse_reserve
from kvwall.report.tables import console, table
from kvwall.units import fmt_bytes, parse_bytes, real, seconds_arg, whole

SWEEPABLE = {"tp": "tp", "pp": "pp", "ep": "ep", "kv-format": "kv_format", "weight-format": "weight_format",
             "max-batch": "max_batch", "chunk": "chunk", "shared-prefix": "shared_prefix", "rate": "rate",
             "concurrency": "concurrency"}
RATE_RANGE = (0.01, 10_000.0)  # requests per second searched by --find-rate


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
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args) -> int:
    plot = check_output(args.plot, PLOT_EXTS, option="--plot") if args.plot else None
    if args.find_rate and not (args.slo_ttft or args.slo_tpot):
        raise KvwallError("--find-rate needs an SLO: give --slo-ttft and/or --slo-tpot, e.g. --slo-ttft 1s")
    if args.find_rate and (args.rate is not None or args.concurrency is not None or _sweeps(args, "rate")
                           or _sweeps(args, "concurrency")):
        raise KvwallError("--find-rate searches the rate itself: drop --rate / --concurrency (or --find-rate)")
    if args.rate is None and args.concurrency is None and not args.find_rate and not _sweeps(args, "rate"):
        raise KvwallError("say how requests come: --rate R (Poisson, per second), --concurrency C, or --find-rate")
    runs = [_point(a) for a in _grid(args)]
    points = [p for p, _ in runs]
    data = {"model": args.model, "device": args.device, "points": points}
    if plot:
        _plot(points, runs[0][1], plot)
        data["plot"] = args.plot
    return common.emit(args, data, _print)


def _sweeps(args, key: str) -> bool:
    return any(s.split("=", 1)[0] == key for s in args.sweep or [])


def _grid(args) -> list[argparse.Namespace]:
    """The option sets a --sweep names (one, without it); each value parsed by the option's own rules."""
    axes, seen = [], set()
    for item in args.sweep or []:
        key, _, values = item.partition("=")
        if key not in SWEEPABLE or not values:
            raise KvwallError(f"bad --sweep {item!r}: write KEY=V1,V2 with KEY one of {', '.join(SWEEPABLE)}")
        if key in seen:
            raise KvwallError(f"--sweep names {key} twice; give its values once: {key}=V1,V2")
        seen.add(key)
        axes.append([(key, v) for v in dict.fromkeys(v.strip() for v in values.split(",") if v.strip())])
    out = []
    for combo in itertools.product(*axes):
        a = copy.copy(args)
        for key, value in combo:
            setattr(a, SWEEPABLE[key], _typed(key, value))
        if a.rate is not None and a.concurrency is not None:
            raise KvwallError("--sweep sets both a rate and a concurrency; sweep one of them")
        a.label = " ".join(f"{k}={v}" for k, v in combo) or "run"
        out.append(a)
    return out


def _typed(key: str, value: str):
    parse = {"rate": real(0, 1e6, lo_open=True), "concurrency": whole(1, 1 << 20)}.get(key)
    if key in ("tp", "pp", "ep", "max-batch", "chunk"):
        parse = whole(1, 1 << 20)
    if key == "shared-prefix":
        parse = whole(0, 1 << 24)
    try:
        return parse(value) if parse else value
    except argparse.ArgumentTypeError as exc:
        raise KvwallError(f"bad --sweep value {key}={value}: {exc}") from None


def _point(args) -> dict:
    """One configuration: simulated at its rate or concurrency, or the largest rate that meets the SLO."""
    from kvwall import simulate as sim
    from kvwall import workload

    spec, fm, notes = common.model_and_formats(args.model, args)
    par = common.parallel(args)
    roof = roof_from(args, spec, fm, par.group)
    memory_bytes = roof.device.memory_bytes
    kv = parse_bytes(args.kv_memory, "--kv-memory") if args.kv_memory else None
    pool = sim.kv_pool(spec, fm, par, memory_bytes, parse_reserve(args.reserve, memory_bytes), args.block_size,
                       args.max_batch, kv)
    clock = sim.StepClock(spec, fm, roof, par, args.block_size)

    def requests(rate):
        if args.dataset:
            reqs = workload.load_dataset(args.dataset, args.requests, rate, args.seed)
        else:
            reqs = workload.stream(args.requests, workload.parse_lengths(args.prompt_tokens, "--prompt-tokens"),
                                   workload.parse_lengths(args.output_tokens, "--output-tokens"), rate, args.seed)
        reqs = workload.with_shared_prefix(reqs, args.shared_prefix)
        sim.check_context(reqs, spec)
        return reqs

    last = {}

    def run_at(rate, concurrency=None):
        what = f"rate {rate:g}/s" if rate else f"concurrency {concurrency}"
        with _progress(args, f"{args.label}: {what} ...") as tick:
            run = sim.simulate(requests(rate), clock, pool, args.chunk, args.max_batch, args.split_prefill,
                               concurrency, tick)
        last["latencies"] = {"TTFT": [r.ttft for r in run["records"]], "TPOT": [r.tpot for r in run["records"]]}
        return sim.report(run, args.slo_ttft, args.slo_tpot)

    out = {"label": args.label, "model": spec.name, "device": roof.device.name, **par.as_dict(),
           "formats": fm.as_dict(), "pool": pool.as_dict(), "chunk": args.chunk, "max_batch": args.max_batch,
           "split_prefill": args.split_prefill, "shared_prefix": args.shared_prefix, "roof": describe(roof),
           "assumptions": sim.ASSUMPTIONS | roof.assumptions(), "notes": notes}
    if args.find_rate:
        found = sim.find_rate(run_at, args.slo_ttft, args.slo_tpot, *RATE_RANGE)
        out |= {"mode": "find-rate", "rate": found["rate"], "tried": found["tried"], **found["report"]}
        if found["limited_by_requests"]:
            out["notes"] = notes + [f"at higher rates the SLO held only because {args.requests} requests all arrived "
                                    "within one median latency (a burst, not a rate): raise --requests to look further"]
    else:
        out |= {"mode": "concurrency" if args.concurrency else "rate", "rate": args.rate,
                "concurrency": args.concurrency, **run_at(args.rate, args.concurrency)}
    return out, last.get("latencies", {})


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


def _plot(points: list[dict], latencies: dict, path) -> None:
    """One run: its latency CDFs and KV pool over time; a sweep: throughput per GPU against p90 TPOT."""
    from kvwall.report import plots

    p = points[0]
    if len(points) == 1:
        plots.serving(latencies, p["trace"], p["pool"]["n_blocks"],
                      f"{p['model']} on {p['device']} tp={p['tp']} ({p['label']}): simulated serving", path)
        return
    plots.pareto([{"label": p["label"], "x": (p.get("tpot_s") or {}).get("p90"), "y": _per_gpu(p)} for p in points],
                 "p90 time per output token (s)", "output tok/s per GPU",
                 f"{points[0]['model']} on {points[0]['device']}: throughput per GPU against latency", path)
