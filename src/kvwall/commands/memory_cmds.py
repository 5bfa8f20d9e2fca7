"""`kvwall models | devices | show | memory | compare | fit`: the memory predictor on the command line."""

from __future__ import annotations

import argparse

from kvwall import api, catalog
from kvwall.commands import common
from kvwall.predict import devices as dev
from kvwall.predict.memory import cache_bytes_per_token, state_bytes
from kvwall.report.tables import console, table
from kvwall.spec.families import family
from kvwall.spec.gguf_meta import file_weights, gguf_file, read_meta, weight_format
from kvwall.spec.resolve import load_spec
from kvwall.units import fmt_bytes, fmt_count, fmt_tokens, whole

LINEUP = api.LINEUP
COMPARE_CONTEXTS = api.COMPARE_CONTEXTS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the catalog of real models")
    common.add_json(p)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("devices", help="list the accelerator catalog with machine balance")
    common.add_json(p)
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("show", help="a model's layers, parameters and cache per token")
    p.add_argument("model", help="catalog name, hub id, config.json or checkpoint directory")
    common.add_model_knobs(p)
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("memory", help="weights and cache for a batch and context, per layer and per GPU")
    p.add_argument("model")
    p.add_argument("--context", default="4k", help="tokens per sequence (e.g. 4096, 128k, 1M; default 4k)")
    p.add_argument("--batch", type=whole(1), default=1, help="sequences (default 1)")
    p.add_argument("--block-size", type=whole(1), metavar="B",
                   help="paged allocation: round each sequence up to B-token blocks")
    p.add_argument("--device", help="also say whether it fits this device (see `kvwall devices`)")
    p.add_argument("--layers", action="store_true", help="print every layer")
    common.add_model_knobs(p)
    common.add_parallel(p)
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("compare", help="cache per token and at several contexts, side by side")
    p.add_argument("models", nargs="*", help=f"models (default: {' '.join(LINEUP)})")
    p.add_argument("--context", default=COMPARE_CONTEXTS, help=f"contexts (default {COMPARE_CONTEXTS})")
    p.add_argument("--batch", type=whole(1), default=1)
    p.add_argument("--device", default=None,
                   help="device (default h100-sxm) for the 'longest context that fits' column")
    p.add_argument("--memory", help="memory size instead of a device, e.g. 80GB")
    common.add_model_knobs(p)
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("fit", help="the longest context for a batch, or the largest batch for a context")
    p.add_argument("model")
    p.add_argument("--device", help="catalog device (default h100-sxm unless --memory)")
    p.add_argument("--memory", help="memory per GPU instead of a device, e.g. 80GB or 24GiB")
    p.add_argument("--batch", type=whole(1), help="find the longest context for this batch (default 1)")
    p.add_argument("--context", help="find the largest batch for this context")
    p.add_argument("--reserve", help="memory kept free per GPU: a percentage or size (default 10%%)")
    p.add_argument("--block-size", type=whole(1), metavar="B", help="paged allocation block size")
    common.add_model_knobs(p)
    common.add_parallel(p)
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_fit)


# -- models / devices ----------------------------------------------------------

def cmd_models(args) -> int:
    rows = []
    for name in catalog.model_names():
        cfg = catalog.load_model_config(name)
        spec = load_spec(name)
        rows.append({
            "name": name, "hub_id": cfg.get("_hub_id"), "model_type": spec.model_type, "family": spec.family(),
            "params": spec.params(), "active_params": spec.active_params(), "layers": spec.n_layers,
            "max_context": spec.max_context, "engine": _engine(spec.model_type), "source": cfg.get("_source"),
            "unconfirmed": cfg.get("_unconfirmed", []),
        })
    return common.emit(args, rows, _print_models)


def _engine(model_type: str) -> str:
    """Whether kvwall's engine runs this model_type (from the family registry), or why not."""
    fam = family(model_type)
    return "runs" if fam and fam.runs_in_engine else f"no: {fam.why_not if fam else 'unknown model_type'}"


def _print_models(rows: list[dict]) -> None:
    t = table("kvwall catalog: real models' config.json (sources: kvwall/catalog/models/*.json)",
              ["name", "hub id", "type", "family", "params", "active", "layers", "max ctx", "engine"],
              [[r["name"], r["hub_id"], r["model_type"], r["family"], fmt_count(r["params"]),
                fmt_count(r["active_params"]), r["layers"], fmt_tokens(r["max_context"]) if r["max_context"] else "-",
                r["engine"]] for r in rows],
              caption="engine: whether `kvwall generate / verify / bench` run the family (spec/families.py)")
    console().print(t)


def cmd_devices(args) -> int:
    devs = [dev.get_device(n) for n in dev.device_names()]
    data = {"devices": [d.as_dict() | {"balance_bf16": _balance(d, "bf16"), "balance_fp8": _balance(d, "fp8")}
                        for d in devs], "balance_trend": dev.balance_trend()}
    return common.emit(args, data, lambda data: _print_devices(devs, data["balance_trend"]))


def _print_devices(devs: list[dev.Device], trend: list[dict]) -> None:
    rows = []
    for d in devs:
        rows.append([d.name, d.year or "-", f"{d.memory_bytes / 1e9:g} GB", f"{d.bandwidth / 1e9:,.0f} GB/s",
                     _tflops(d, "bf16"), _tflops(d, "fp8"), _tflops(d, "fp4"),
                     _fmt_balance(_balance(d, "bf16")), _fmt_balance(_balance(d, "fp8")),
                     f"{d.interconnect_bw * 2 / 1e9:,.0f} GB/s" if d.interconnect_bw else "-"])
    t = table("Accelerators (dense peaks; balance = FLOP per byte at which compute and memory take equal time)",
              ["device", "year", "memory", "bandwidth", "bf16 TFLOP/s", "fp8", "fp4", "balance bf16", "fp8",
               "link (bidir)"], rows, caption="Sources and unconfirmed figures: `kvwall devices --json`.")
    c = console()
    c.print(t)
    c.print(table("Compute outgrows bandwidth: dense 16-bit peak vs memory bandwidth across generations",
                  ["device", "year", "TFLOP/s", "x V100", "GB/s", "x V100", "balance FLOP/B"],
                  [[r["device"], r["year"], f"{r['flops'] / 1e12:,.0f}", f"{r['flops_growth']:.1f}x",
                    f"{r['bandwidth'] / 1e9:,.0f}", f"{r['bandwidth_growth']:.1f}x", f"{r['balance']:,.0f}"]
                   for r in trend]))


def _peak(d: dev.Device, dtype: str) -> float | None:
    return d.peak_flops.get(dtype)


def _tflops(d: dev.Device, dtype: str) -> str:
    v = _peak(d, dtype)
    return f"{v / 1e12:,.0f}" if v else "-"


def _balance(d: dev.Device, dtype: str) -> float | None:
    v = _peak(d, dtype)
    return v / d.bandwidth if v else None


def _fmt_balance(b: float | None) -> str:
    return f"{b:,.0f}" if b else "-"


# -- show ----------------------------------------------------------------------

def cmd_show(args) -> int:
    spec, fm, notes = common.model_and_formats(args.model, args)
    data = {
        "name": spec.name, "model_type": spec.model_type, "family": spec.family(), "hidden": spec.hidden,
        "vocab": spec.vocab, "layers": spec.n_layers, "tied_embeddings": spec.tied_embeddings,
        "max_context": spec.max_context, "dtype": spec.dtype,
        "params": spec.params(), "active_params": spec.active_params(), "formats": fm.as_dict(),
        "cache_bytes_per_token": cache_bytes_per_token(spec, fm.kv),
        "state_bytes_per_sequence": state_bytes(spec, fm.state),
        "layer_groups": [{"layer": desc, "indices": idx} for desc, idx in spec.layer_groups()],
        "notes": list(spec.notes) + notes,
    }
    gguf = gguf_file(args.model)
    if gguf is not None:  # the weights as the file stores them, in its own quantized formats
        _check_gguf_tensors(gguf)
        meta = read_meta(gguf)
        data["file_weights"], data["file_weight_format"] = file_weights(meta), weight_format(meta)
    return common.emit(args, data, lambda data: _print_show(data, spec, fm))


def _check_gguf_tensors(path) -> None:
    """The file's tensors against its metadata, as loading checks them (needs torch; without it the metadata's
    sizes are still checked against their tensors when the spec is read)."""
    try:
        from kvwall.engine.gguf import check_tensors
    except ImportError:
        return
    check_tensors(path)


def _print_show(data: dict, spec, fm) -> None:
    c = console()
    c.print(f"[bold]{spec.name}[/bold]  ({spec.model_type}, {spec.family()})  hidden {spec.hidden}, "
            f"vocab {spec.vocab}, {spec.n_layers} layers, embeddings {'tied' if spec.tied_embeddings else 'untied'}, "
            f"max context {fmt_tokens(spec.max_context) if spec.max_context else 'unknown'}")
    active = f" ({spec.active_params():,} active per token)" if spec.active_params() != spec.params() else ""
    c.print(f"parameters: {spec.params():,}{active}")
    c.print(f"cache per token: {fmt_bytes(data['cache_bytes_per_token'])} ({data['cache_bytes_per_token']:,} B, "
            f"KV in {fm.kv.label}); fixed state per sequence: {fmt_bytes(data['state_bytes_per_sequence'])}")
    t = table("layers", ["layer", "count", "indices"],
              [[desc, len(idx), _ranges(idx)] for desc, idx in spec.layer_groups()])
    c.print(t)
    if "file_weights" in data:
        _print_file_weights(data["file_weights"])
        if data["file_weight_format"]:
            c.print(f"as a weight format: --weight-format {data['file_weight_format']} (kvwall memory / roofline / "
                    "speed predict the file's own bytes with it)")
    for note in data["notes"]:
        c.print(f"note: {note}")


def _print_file_weights(rows: list[dict]) -> None:
    total = sum(r["bytes"] for r in rows)
    body = [[r["type"], r["tensors"], f"{r['params']:,}", fmt_bytes(r["bytes"]), f"{8 * r['bytes'] / r['params']:.2f}"]
            for r in rows]
    console().print(table(f"weights in the file: {fmt_bytes(total)} ({total:,} B)",
                          ["GGML type", "tensors", "parameters", "bytes", "bits/param"], body))


def _ranges(idx: list[int]) -> str:
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    text = ", ".join(out)
    return text if len(text) < 60 else text[:57] + "..."


# -- memory --------------------------------------------------------------------

def cmd_memory(args) -> int:
    r = api.memory(args.model, context=args.context, batch=args.batch, block_size=args.block_size,
                   device=args.device, **common.model_knobs(args), **common.parallel_sizes(args))
    return common.emit(args, r.to_dict(), lambda data: _print_memory(data, r, args))


def _print_memory(data: dict, r: api.MemoryResult, args) -> None:
    rep, spec, fm, device = r.report, r.spec, r.formats, data.get("device")
    w, cache = rep.per_gpu()
    ctx = rep.context
    c = console()
    par = f", {rep.parallel.label()}" if rep.parallel.gpus > 1 else ""
    c.print(f"[bold]{spec.name}[/bold]: batch {args.batch} x {fmt_tokens(ctx)} tokens; weights {fm.weights.label}, "
            f"KV {fm.kv.label}, state {fm.state.label}{par}")
    rows = [["weights", fmt_bytes(rep.weight_bytes), f"{rep.weight_bytes:,}"],
            ["cache", fmt_bytes(rep.cache_bytes), f"{rep.cache_bytes:,}"]]
    if args.block_size:
        waste = rep.cache_bytes - rep.cache_used_bytes
        rows.append([f"  of which paging waste ({args.block_size}-token blocks)", fmt_bytes(waste), f"{waste:,}"])
    rows.append(["total", fmt_bytes(rep.weight_bytes + rep.cache_bytes), f"{rep.weight_bytes + rep.cache_bytes:,}"])
    if rep.parallel.gpus > 1:
        rows.append([f"per GPU (busiest of {rep.parallel.gpus})", fmt_bytes(w + cache),
                     f"{w:,} weights + {cache:,} cache"])
    c.print(table("memory", ["", "size", "bytes"], rows))
    c.print(f"cache per token: {fmt_bytes(data['cache_bytes_per_token'])} "
            f"({data['cache_bytes_per_token']:,} B); fixed state per sequence: {fmt_bytes(rep.fixed_bytes)}")
    if device:
        verdict = "fits" if data["device"]["fits"] else "does NOT fit"
        c.print(f"on {device['name']} ({device['memory_bytes'] / 1e9:g} GB per GPU, 10% kept in reserve): {verdict}, "
                f"{fmt_bytes(abs(data['device']['free_bytes']))} {'free' if data['device']['fits'] else 'short'}")
    shard = "per GPU" if rep.parallel.pp == 1 else f"per GPU of its stage, all {rep.parallel.pp} stages"
    if args.layers:
        c.print(table(f"per layer ({shard})",
                      ["layer", "kind", "weights", "B/token", "tokens held", "cache", "state/seq"],
                      [[layer.index, layer.kind, fmt_bytes(layer.weight_bytes), f"{layer.token_bytes:,}",
                        f"{layer.tokens_held:,}", fmt_bytes(layer.cache_bytes), fmt_bytes(layer.fixed_bytes)]
                       for layer in rep.layers]))
    else:
        c.print(table(f"per layer kind ({shard})", ["kind", "layers", "B/token", "cache", "state/seq"],
                      _kinds(rep.layers)))
    for note in data["notes"]:
        c.print(f"note: {note}")


def _kinds(layers) -> list[list]:
    groups: dict[str, list] = {}
    for layer in layers:
        g = groups.setdefault(layer.kind, [0, 0, 0, 0])
        g[0] += 1
        g[1] += layer.token_bytes
        g[2] += layer.cache_bytes
        g[3] += layer.fixed_bytes
    return [[k, n, f"{tb:,}", fmt_bytes(cb), fmt_bytes(fb)] for k, (n, tb, cb, fb) in groups.items()]


# -- compare -------------------------------------------------------------------

def cmd_compare(args) -> int:
    r = api.compare(args.models, context=args.context, batch=args.batch, device=args.device, memory=args.memory,
                    **common.model_knobs(args))
    return common.emit(args, r.to_dict(), _print_compare)


def _print_compare(data: dict) -> None:
    contexts = data["contexts"]
    rows = []
    for r in data["models"]:
        if not r["fits"]:
            longest = "weights do not fit 8"
        elif r["max_context_unbounded"]:
            longest = "any (fixed state)"
        else:
            longest = f"{r['max_context']:,}" if r["max_context"] else "none"
        longest += f" (tp {r['tp']})" if r["fits"] and r["tp"] > 1 else ""
        top = r["model_max_context"]
        rows.append([r["model"], r["family"], fmt_count(r["params"]), fmt_tokens(top) if top else "-",
                     fmt_bytes(r["cache_bytes_per_token"]), fmt_bytes(r["growth_bytes_per_token"]),
                     fmt_bytes(r["state_bytes_per_sequence"]) if r["state_bytes_per_sequence"] else "-",
                     *[fmt_bytes(r["cache_bytes"][str(c)]) for c in contexts],
                     longest])
    title = (f"Cache for batch {data['batch']} (KV/state in each model's 16-bit type unless --kv-format); "
             f"longest context next to the weights on {data['memory_target']}")
    caption = ("cache/token: bytes each token adds while every layer still keeps it; past windows: what each token "
               "adds once sliding layers are full. max ctx: the model's trained maximum (contexts past it are "
               "what-ifs). longest ctx: on the smallest group of 1, 2, 4 or 8 such GPUs (tp N) that holds the weights; "
               "10% of memory kept in reserve for activations and runtime.")
    console().print(table(title, ["model", "family", "params", "max ctx", "cache/token", "past windows", "fixed state",
                                  *[f"@{fmt_tokens(c)}" for c in contexts], "longest ctx"], rows, caption=caption))
    for note in common.weights_notes(data["models"]):
        console().print(f"note: {note}")


# -- fit -----------------------------------------------------------------------

def cmd_fit(args) -> int:
    r = api.fit(args.model, device=args.device, memory=args.memory, batch=args.batch, context=args.context,
                reserve=args.reserve, block_size=args.block_size, **common.model_knobs(args),
                **common.parallel_sizes(args))
    return common.emit(args, r.to_dict(), lambda data: _print_fit(data, r))


def _print_fit(data: dict, res: api.FitResult) -> int:
    """The verdict in words; 1 when the weights do not fit (the exit status of `kvwall fit`)."""
    spec, fm, par = res.spec, res.formats, res.parallel
    c = console()
    where, mem_bytes, ctx = data["device"], res.memory_bytes, res.context
    gpus = f" x {par.gpus} GPUs ({par.label()})" if par.gpus > 1 else ""
    c.print(f"[bold]{spec.name}[/bold] on {where}{gpus}; weights {fm.weights.label}, KV {fm.kv.label}")
    c.print(f"per GPU: {mem_bytes / 1e9:g} GB = {fmt_bytes(mem_bytes)} memory - {fmt_bytes(res.reserve_bytes)} "
            f"reserve - {fmt_bytes(res.weights_bytes)} weights = {fmt_bytes(max(res.available_bytes, 0))} "
            "for the cache")
    if not res.weights_fit:
        c.print("[red]weights do not fit[/red]: use more GPUs (--tp/--pp), a smaller --weight-format, "
                "or a bigger device")
        return 1
    if ctx is None:
        b = res.batch
        if res.unbounded:
            c.print(f"batch {b}: any context fits (the cache stops growing: fixed state / sliding windows)")
        elif res.max_context == 0:
            c.print(f"batch {b}: not even one token of context fits")
        else:
            over = (f" (beyond the model's trained maximum of {fmt_tokens(spec.max_context)})"
                    if spec.max_context and res.max_context > spec.max_context else "")
            short = fmt_tokens(res.max_context)
            short = f" ({short})" if short != str(res.max_context) else ""
            c.print(f"batch {b}: longest context [bold]{res.max_context:,}[/bold] tokens{short}{over}")
    else:
        c.print(f"context {fmt_tokens(ctx)}: largest batch [bold]{res.max_batch:,}[/bold] sequences")
    for note in data["notes"]:
        c.print(f"note: {note}")
    return 0
