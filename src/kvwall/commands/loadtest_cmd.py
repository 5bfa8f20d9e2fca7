"""`kvwall loadtest URL`: drive an OpenAI-compatible server with a request stream; latency percentiles, throughput."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from kvwall.commands import common
from kvwall.errors import KvwallError
from kvwall.files import PLOT_EXTS, check_output
from kvwall.report.tables import console, table
from kvwall.units import real, seconds_arg, whole


def sweep(text: str) -> tuple[str, list[float]]:
    """'rate=0.5,1,2' -> ("rate", [0.5, 1, 2]); concurrency values are whole numbers."""
    kind, _, values = text.partition("=")
    try:
        nums = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        nums = []
    whole_ok = kind != "concurrency" or all(v == int(v) for v in nums)
    if kind not in ("rate", "concurrency") or not nums or not whole_ok or not all(0 < v <= 1e6 for v in nums):
        raise argparse.ArgumentTypeError(f"must be rate=R1,R2,... or concurrency=C1,C2,... (got {text!r})")
    return kind, nums


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="load an OpenAI-compatible server (kvwall serve, vLLM, llama.cpp): "
                       "TTFT, TPOT, e2e percentiles and throughput")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name the server serves")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--rate", type=real(0, 1e6, lo_open=True), help="Poisson arrivals, requests per second (at "
                     "least 1 / --timeout: a slower stream loads nothing, no two requests overlapping)")
    how.add_argument("--concurrency", type=whole(1, 1 << 16), help="this many clients, each one request at a time")
    how.add_argument("--sweep", type=sweep, metavar="KIND=V1,V2,...",
                     help="a series, e.g. rate=0.5,1,2,4 or concurrency=1,4,16 (--plot: throughput and p99 vs load)")
    p.add_argument("--requests", type=whole(1, 1 << 20), default=32, metavar="N", help="default 32")
    p.add_argument("--prompt-tokens", type=whole(1, 1 << 20), default=128, help="prompt words (default 128)")
    p.add_argument("--output-tokens", type=whole(1, 1 << 20), default=64, help="max_tokens (default 64)")
    p.add_argument("--seed", type=whole(0, 2**63 - 1), default=0)
    p.add_argument("--timeout", type=seconds_arg, default=120.0, help="per request (default 120s)")
    p.add_argument("--slo-ttft", type=seconds_arg, help="goodput counts requests with TTFT at most this, e.g. 1s")
    p.add_argument("--slo-tpot", type=seconds_arg, help="... and time per output token at most this, e.g. 100ms")
    p.add_argument("--shared-prefix", type=whole(0, 1 << 20), default=0, metavar="WORDS",
                   help="every prompt begins with the same WORDS random words (a system prompt), before its own "
                        "(default 0)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dataset", metavar="JSONL", help='prompts, one {"prompt": "..."} per line, sent in turn')
    what.add_argument("--token-ids", type=whole(1, 1 << 24), metavar="VOCAB",
                      help="send each prompt as exactly --prompt-tokens random token ids below VOCAB (the model's "
                           "vocabulary size or less) instead of words: a token-exact length, e.g. a prompt that "
                           "with its output fills the whole context")
    p.add_argument("--plot", metavar="PNG", help="latency CDFs (TTFT, TPOT, end to end)")
    p.add_argument("--api-key", metavar="KEY")
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_loadtest)


def cmd_loadtest(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise KvwallError("loadtest needs httpx: pip install 'kvwall[serve]'") from None
    from kvwall.measure import loadtest

    loadtest.base_url(args.url)  # one-line errors for a malformed URL or path before anything is sent
    for rate, option in _rates(args):
        loadtest.check_rate(rate, args.timeout, args.requests, option)
    plot = check_output(args.plot, PLOT_EXTS, option="--plot") if args.plot is not None else None
    dataset = loadtest.read_dataset(args.dataset) if args.dataset else None
    load = loadtest.Load(args.url, args.model, args.requests, args.rate, args.concurrency, args.prompt_tokens,
                         args.output_tokens, args.seed, args.timeout, args.api_key, dataset, args.shared_prefix,
                         args.token_ids or 0)
    if args.sweep:
        return _sweep(args, load, plot)
    data = _one(args, load)
    if plot:
        from kvwall.report.measured import plot_loadtest

        plot_loadtest(data, plot)
        data["plot"] = str(plot)
    return common.emit(args, data, _print)


def _rates(args) -> list[tuple[float, str]]:
    """The Poisson rates asked for, each with the option that gave it."""
    if args.sweep and args.sweep[0] == "rate":
        return [(v, "--sweep rate") for v in args.sweep[1]]
    return [(args.rate, "--rate")] if args.rate else []


def _one(args, load) -> dict:
    from kvwall.measure import loadtest

    samples, wall = asyncio.run(_with_progress(load, quiet=args.json))
    data = loadtest.summarize(load, samples, wall, args.slo_ttft, args.slo_tpot)
    if not data["completed"]:
        raise KvwallError(f"no request to {args.url} completed ({data['first_errors'][0]}); is the server up and "
                          f"serving {args.model!r}?")
    return data


def _sweep(args, load, plot) -> int:
    """One loadtest per value of the sweep, in order; the samples are left out of the result."""
    kind, values = args.sweep
    points = []
    for v in values:
        step = dataclasses.replace(load, rate=v if kind == "rate" else None,
                                   concurrency=int(v) if kind == "concurrency" else None)
        point = {k: x for k, x in _one(args, step).items() if k != "samples"}
        points.append(dict(point, load=v))
    data = {"url": args.url, "model": args.model, "sweep": kind, "points": points}
    if plot:
        from kvwall.report.measured import plot_sweep

        plot_sweep(data, plot)
        data["plot"] = str(plot)
    return common.emit(args, data, _print_sweep)


async def _with_progress(load, quiet: bool):
    from rich.progress import Progress

    from kvwall.measure import loadtest

    with Progress(console=console(), transient=True, disable=quiet) as progress:
        task = progress.add_task("requests", total=load.requests)
        return await loadtest.run(load, lambda s: progress.update(task, advance=1))


def _print_sweep(d: dict) -> None:
    rows = [[f"{p['load']:g}", f"{p['request_throughput']:.2f}", f"{p['output_token_throughput']:.1f}",
             _ms(p["ttft_s"], "p50"), _ms(p["ttft_s"], "p99"), _ms(p["tpot_s"], "p50"), _ms(p["tpot_s"], "p99"),
             _ms(p["e2e_s"], "p99"), p["errors"]] for p in d["points"]]
    console().print(table(f"loadtest sweep {d['url']} ({d['model']})",
                          [d["sweep"], "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99", "TPOT p50 ms", "TPOT p99",
                           "e2e p99 ms", "errors"], rows))


def _ms(p: dict | None, key: str) -> str:
    return f"{p[key] * 1e3:.1f}" if p else "-"


def _print(d: dict) -> None:
    rows = [[name, _ms(d[key], "mean"), _ms(d[key], "p50"), _ms(d[key], "p90"), _ms(d[key], "p99")]
            for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("e2e", "e2e_s"))]
    caption = (f"{d['completed']}/{d['requests']} completed, {d['errors']} errors in {d['wall_s']:.2f} s; "
               f"{d['request_throughput']:.2f} req/s, {d['output_token_throughput']:.1f} output tok/s")
    if d["slo_ttft_s"] is not None or d["slo_tpot_s"] is not None:
        caption += f"; goodput {d['goodput']:.2f} req/s under the SLO"
    console().print(table(f"loadtest {d['url']} ({d['model']}, {d['mode']})", ["ms", "mean", "p50", "p90", "p99"],
                          rows, caption))
