"""`kvwall loadtest URL`: drive an OpenAI-compatible server with a request stream; latency percentiles, throughput."""

from __future__ import annotations

import argparse
import asyncio
import re

from kvwall.commands import common
from kvwall.errors import KvwallError
from kvwall.report.tables import console, table
from kvwall.units import real, whole


def duration(text: str) -> float:
    """'1s', '100ms', '0.5' (seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive time such as 1s or 100ms (got {text!r})")
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="load an OpenAI-compatible server (kvwall serve, vLLM, llama.cpp): "
                       "TTFT, TPOT, e2e percentiles and throughput")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name the server serves")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--rate", type=real(0, 1e6, lo_open=True), help="Poisson arrivals, requests per second")
    how.add_argument("--concurrency", type=whole(1, 1 << 16), help="this many clients, each one request at a time")
    p.add_argument("--requests", type=whole(1, 1 << 20), default=32, metavar="N", help="default 32")
    p.add_argument("--prompt-tokens", type=whole(1, 1 << 20), default=128, help="prompt words (default 128)")
    p.add_argument("--output-tokens", type=whole(1, 1 << 20), default=64, help="max_tokens (default 64)")
    p.add_argument("--seed", type=whole(0, 2**63 - 1), default=0)
    p.add_argument("--timeout", type=duration, default=120.0, help="per request (default 120s)")
    p.add_argument("--slo-ttft", type=duration, help="goodput counts requests with TTFT at most this, e.g. 1s")
    p.add_argument("--slo-tpot", type=duration, help="... and time per output token at most this, e.g. 100ms")
    p.add_argument("--api-key", metavar="KEY")
    common.add_json(p)
    p.set_defaults(func=cmd_loadtest)


def cmd_loadtest(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise KvwallError("loadtest needs httpx: pip install 'kvwall[serve]'") from None
    from kvwall.measure import loadtest

    loadtest.base_url(args.url)  # a one-line error for a malformed URL before anything is sent
    load = loadtest.Load(args.url, args.model, args.requests, args.rate, args.concurrency, args.prompt_tokens,
                         args.output_tokens, args.seed, args.timeout, args.api_key)
    samples, wall = asyncio.run(_with_progress(load, quiet=args.json))
    data = loadtest.summarize(load, samples, wall, args.slo_ttft, args.slo_tpot)
    if not data["completed"]:
        raise KvwallError(f"no request to {args.url} completed ({data['first_errors'][0]}); is the server up and "
                          f"serving {args.model!r}?")
    return common.emit(args, data, _print)


async def _with_progress(load, quiet: bool):
    from rich.progress import Progress

    from kvwall.measure import loadtest

    with Progress(console=console(), transient=True, disable=quiet) as progress:
        task = progress.add_task("requests", total=load.requests)
        return await loadtest.run(load, lambda s: progress.update(task, advance=1))


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
