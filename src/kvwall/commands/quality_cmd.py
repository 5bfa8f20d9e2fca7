"""`kvwall quality`: what each cache strategy costs in quality on a trained model (kvwall.measure.quality)."""

from __future__ import annotations

import argparse
import time

from kvwall.commands import common
from kvwall.errors import KvwallError
from kvwall.files import PLOT_EXTS, check_output
from kvwall.report.tables import console, table
from kvwall.spec.gguf_meta import INSTALL_HINT
from kvwall.units import fmt_bytes, fmt_tokens, parse_token_list, tokens_arg, whole

DEFAULTS = dict(tokens=1024, rows=4, prefill=16, lengths="1k", keys=20)  # the report's quick plan, plus pass key


def register(sub: argparse._SubParsersAction) -> None:
    d = DEFAULTS
    p = sub.add_parser(
        "quality", help="perplexity, KL, top-1 agreement and pass-key retrieval of each cache strategy",
        description="Teacher-forced perplexity through the decode path, KL divergence and top-1 agreement against "
                    "the exact (contiguous) cache, cache bytes per token, and pass-key retrieval, per cache strategy. "
                    "Time: strategies x (tokens / rows - prefill) decode steps of a batch of R rows, plus "
                    "strategies x 3 depths x K prompts of each pass-key length (prefilled, compute-bound). On "
                    "SmolLM2-135M with 2 quiet CPU cores the default perplexity (7 strategies, 4 rows of 256) takes "
                    "98 s; pass key costs a 1k prefill per prompt and strategy (22 s each measured on a busy machine "
                    "before the engine's fast path; far less when quiet), so the default 1k x 3 depths x 20 keys "
                    "takes tens of minutes: --no-passkey, fewer --keys or --cache for less; --passkey-lengths "
                    "1k,2k,4k for the full grid. Long rows (--row-tokens 4k --chunk 32) add Δ perplexity per "
                    "context band (0-1k, 1k-4k, 4k-16k, 16k-L).")
    p.add_argument("checkpoint", metavar="MODEL", help=f"smollm2-135m / gemma-3-270m ({INSTALL_HINT}), a .gguf "
                   "file, or a checkpoint directory with a tokenizer.json")
    p.add_argument("--cache", metavar="LIST", help="comma-separated strategies (default: contiguous, fp8, int8, "
                   "int4, int2, sliding:W and sliding:W:sink4 with W a quarter of a row; with a native window also "
                   "sliding and what-if windows of half and double it); contiguous, the reference, always runs")
    p.add_argument("--text", metavar="FILE", help="UTF-8 text (default: the prose of the Python Language "
                   "Reference shipped with CPython)")
    p.add_argument("--tokens", type=tokens_arg, metavar="N",
                   help=f"tokens of text scored, e.g. 4096 or 4k (default {d['tokens']}; with --row-tokens L: R x L)")
    p.add_argument("--rows", type=whole(1), default=d["rows"], metavar="R",
                   help=f"rows of tokens / R decoded as one batch (default {d['rows']})")
    p.add_argument("--row-tokens", type=tokens_arg, metavar="L",
                   help="tokens per row instead of --tokens / --rows, e.g. 4k: long rows give Δ perplexity by "
                        "context, in bands 0-1k, 1k-4k, 4k-16k, 16k-L (long mode: --row-tokens 4k --rows 2 --chunk 32 "
                        "on SmolLM2, 16k --rows 1 on Gemma 3; the default text holds about 47k tokens)")
    p.add_argument("--chunk", type=whole(1, 4096), default=1, metavar="C",
                   help="tokens fed per pass after the prefill, every one scored (default 1: each prediction by a "
                        "decode step); C > 1 gives the same predictions C times fewer passes, cutting where a KIVI "
                        "cache's quantized part grows, so C is lowered to divide every int format's group (32 for "
                        "int4 / int2)")
    p.add_argument("--prefill", type=whole(1), default=d["prefill"], metavar="P",
                   help=f"tokens per row prefilled before decoding starts (default {d['prefill']})")
    p.add_argument("--residual", type=whole(0, 1 << 24), default=32, metavar="N",
                   help="quantized caches: newest tokens kept in full precision (default 32)")
    p.add_argument("--passkey-lengths", default=d["lengths"], metavar="LIST",
                   help=f"pass-key context lengths, 'max' for the model's context less 16 tokens for the answer "
                        f"(default {d['lengths']}; a 32k prompt on Gemma 3 prefills for minutes per key and strategy)")
    p.add_argument("--keys", type=whole(1), default=d["keys"], metavar="K",
                   help=f"pass keys per length and depth (10/50/90 %%; default {d['keys']}, seeded)")
    p.add_argument("--seed", type=whole(0, 2**63 - 1), default=0, help="pass-key seed (default 0)")
    common.add_weights(p, many=True)
    p.add_argument("--no-passkey", action="store_true", help="perplexity only")
    p.add_argument("--server", metavar="URL", help="measure a served model instead (an OpenAI-compatible server "
                   "that returns prompt logprobs: kvwall serve, vLLM): the same rows and pass-key prompts, made with "
                   "MODEL's tokenizer and sent as token ids; ppl and top-1 accuracy, no KL")
    p.add_argument("--server-model", metavar="NAME", help="with --server: the model name to send (default: the "
                   "one /v1/models lists)")
    p.add_argument("--api-key", metavar="KEY", help="with --server: sent as Authorization: Bearer KEY")
    p.add_argument("--plot", metavar="PATH", help="Δ perplexity vs bytes per token, and a pass-key heat-map per "
                   "strategy (.png, .pdf or .svg)")
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_quality)


def cmd_quality(args) -> int:
    from kvwall.commands.engine_cmds import _checkpoint
    from kvwall.engine.caches.registry import parse_cache

    caches = [parse_cache(c).text for c in args.cache.split(",")] if args.cache else None
    plot = check_output(args.plot, PLOT_EXTS, option="--plot") if args.plot is not None else None
    _rows(args)
    lengths = None if args.no_passkey else _lengths(args.passkey_lengths)
    path = _checkpoint(args.checkpoint)
    if args.server is not None:
        return _served(args, path, lengths)
    common.need_torch("kvwall quality runs the engine")
    from kvwall.measure import quality

    text, source = quality.read_text(args.text)
    started = time.time()
    runs = []
    for weights in args.weights or [None]:  # one model per weight format, each with every cache strategy
        model, tok = quality.load(path, weights)
        caches = quality.with_exact_first(caches or quality.default_strategies(model.spec, args.tokens // args.rows))
        pk = quality.PasskeyPlan(quality.passkey_lengths(lengths, model.spec), args.keys, seed=args.seed) \
            if lengths else None
        plan = quality.Plan(caches, args.tokens, args.rows, args.prefill, args.residual, pk, args.chunk)
        plan.check(model.spec)
        runs.append((weights or "checkpoint", _run_with_progress(model, tok, plan, text, source, quiet=args.json)))
        del model
    data = runs[0][1] if len(runs) == 1 else quality.merge_weights(runs)
    data.update(checkpoint=str(path), seconds=round(time.time() - started, 1))
    data.setdefault("weights", args.weights or ["checkpoint"])
    if plot:
        from kvwall.report.plots import quality as quality_plot

        quality_plot(data, plot)
        data["plot"] = str(plot)
    return common.emit(args, data, print_quality)


def _served(args, path, lengths) -> int:
    """--server URL: quality's rows and pass-key prompts through a server (measure/served_quality.py)."""
    from kvwall.engine.tokenizer import load_tokenizer
    from kvwall.measure import quality, served_quality
    from kvwall.spec.resolve import load_spec

    for option, given in (("--cache", args.cache), ("--weights", args.weights), ("--plot", args.plot)):
        if given:
            raise KvwallError(f"{option} is for the engine's own run; with --server the server's settings decide it "
                              f"(leave {option} out)")
    tok = load_tokenizer(path)
    if tok is None:
        raise KvwallError(f"{path} has no tokenizer (tokenizer.json, or a .gguf's); quality needs one to make the "
                          "token ids it sends")
    spec = load_spec(str(path))
    pk = quality.PasskeyPlan(quality.passkey_lengths(lengths, spec), args.keys, seed=args.seed) if lengths else None
    plan = quality.Plan([], args.tokens, args.rows, args.prefill, args.residual, pk)
    plan.check(spec)
    text, source = quality.read_text(args.text)
    started = time.time()
    data = served_quality.measure(served_quality.Server(args.server, args.server_model, args.api_key), tok, plan,
                                  text, source)
    data.update(checkpoint=str(path), seconds=round(time.time() - started, 1))
    return common.emit(args, data, print_served)


def print_served(data: dict) -> None:
    c = console()
    t = data["text"]
    c.print(f"{data['model']} at {data['server']}: {t['used']:,} tokens of {t['source']} in {t['rows']} rows of "
            f"{t['row_tokens']}, {t['prefill']} + 1 as context per row; took {data['seconds']} s")
    rows = [[r["cache"], f"{r['ppl']:.3f}", f"{r['top1_accuracy'] * 100:.1f}%", f"{r['predictions']:,}"]
            for r in data["quality"]]
    c.print(table("served model", ["model", "ppl", "top-1 accuracy", "predictions"], rows,
                  caption="top-1 accuracy: scored tokens that were the server's most likely; no KL (a server "
                          "returns no full distributions)"))
    if data.get("passkey"):
        _print_passkey(data["passkey"])


def _rows(args) -> None:
    """--row-tokens L sets tokens = rows x L; without it, --tokens (default 1,024) in --rows."""
    if args.row_tokens is None:
        args.tokens = DEFAULTS["tokens"] if args.tokens is None else args.tokens
    elif args.tokens is not None and args.tokens != args.rows * args.row_tokens:
        raise KvwallError(f"--tokens {args.tokens:,} is not --rows {args.rows} x --row-tokens {args.row_tokens:,}; "
                          "give --row-tokens and --rows, or --tokens and --rows")
    else:
        args.tokens = args.rows * args.row_tokens


def _lengths(text: str) -> list[int | str]:
    """--passkey-lengths: token counts (1k, 4096) and 'max'."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    return [p if p == "max" else parse_token_list(p, "pass-key length")[0] for p in parts] or \
        parse_token_list(text, "pass-key length")


def _run_with_progress(model, tok, plan, text, source, quiet: bool) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from kvwall.measure import quality

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn(), TimeRemainingColumn())
    from rich.console import Console

    with Progress(*columns, console=Console(stderr=True), transient=True, disable=quiet) as progress:
        task = progress.add_task("quality", total=quality.steps(plan))
        return quality.measure(model, tok, plan, text, source, lambda n: progress.update(task, advance=n))


def print_quality(data: dict) -> None:
    c = console()
    t = data["text"]
    c.print(f"{data['model']}: {t['used']:,} tokens of {t['source']} in {t['rows']} rows of {t['row_tokens']}, "
            f"{t['prefill']} prefilled per row, then one token per step; took {data['seconds']} s")
    rows = [[r["cache"], f"{r['ppl']:.3f}", f"{r['delta_ppl']:+.3f}", f"{r['kl']:.3g}", f"{r['top1'] * 100:.1f}%",
             fmt_bytes(r["bytes_per_token"]), fmt_bytes(r["predicted_bytes_per_token"])] for r in data["quality"]]
    c.print(table(f"what each strategy costs (rows of {fmt_tokens(t['row_tokens'])}, fp32 cache)",
                  ["cache", "ppl", "Δ ppl", "KL (nats)", "top-1", "bytes/token", "predicted"], rows,
                  caption=f"against the exact {data['quality'][0]['cache']} cache; int* caches keep the newest "
                          f"{data['residual']} .. {data['residual']} + group - 1 tokens in full precision"))
    if len(data["quality"][0].get("bands", [])) > 1:
        _print_bands(data)
    if data.get("passkey"):
        _print_passkey(data["passkey"])
    if data.get("plot"):
        c.print(f"plot written to {data['plot']}")


def _print_bands(data: dict) -> None:
    from kvwall.measure.quality import band_grid

    heads, rows = band_grid(data["quality"])
    console().print(table("Δ perplexity by context (each band: the tokens with that many before them)",
                          ["cache", *heads], rows,
                          caption=f"Δ% against the exact cache's perplexity in the same band; every {data['chunk']} "
                                  "token(s) per pass (the decode path's predictions)"))


def _print_passkey(pk: dict) -> None:
    from kvwall.measure.quality import passkey_grid

    heads, rows = passkey_grid(pk)
    console().print(table(f"pass-key retrieval ({pk['keys']} keys per cell, seed {pk['seed']})", ["cache", *heads],
                          rows, caption="keys answered correctly (greedy) at context length @ depth of the key"))
