"""`kvwall roofline | speed | speculate`: the time predictor on the command line."""

from __future__ import annotations

import argparse

from kvwall import api
from kvwall.commands import common
from kvwall.errors import KvwallError
from kvwall.predict import devices as dev
from kvwall.predict.expected import describe
from kvwall.predict.fit import fit_warning
from kvwall.predict.memory import Parallel, total_weight_bytes
from kvwall.predict.roofline import Roof, speculative
from kvwall.report.analysis import group_ops
from kvwall.report.tables import console, table
from kvwall.units import fmt_bytes, fmt_tokens, one_of, parse_int_list, parse_tokens, real, whole


def add_roof_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("device and roofline assumptions")
    g.add_argument("--device", default="h100-sxm", help="catalog device or `local` (default h100-sxm)")
    g.add_argument("--compute-dtype", type=one_of(dev.COMPUTE_DTYPES), default=None,
                   help="dtype of the math (bf16, fp16, fp8, fp32; default: fp32 or fp16 when the weights are, "
                        "else bf16)")
    g.add_argument("--ideal", action="store_true",
                   help="the ideal roofline (datasheet peaks, no fixed costs: a bound) instead of the default "
                        "expected mode (fractions of peak fitted to published measurements; on `local`, its "
                        "calibration)")
    g.add_argument("--compute-eff", type=real(0, 1, lo_open=True), default=None,
                   help="with --ideal: fraction of peak FLOP/s reached (default 1.0)")
    g.add_argument("--mem-eff", type=real(0, 1, lo_open=True), default=None,
                   help="with --ideal: fraction of bandwidth reached (default 1.0)")
    g.add_argument("--link-latency", type=real(0), default=None,
                   help="with --ideal: microseconds per collective (default 5)")


ROOF_KNOBS = ("device", "compute_dtype", "ideal", "compute_eff", "mem_eff", "link_latency")


def roof_knobs(args) -> dict:
    """The device and roofline options (add_roof_args) as kvwall.api's keyword arguments."""
    return {k: getattr(args, k) for k in ROOF_KNOBS}


def roof_from(args, spec, fm, tp: int = 1) -> Roof:
    """The roof the options describe for this model, formats and collective group of `tp` GPUs
    (kvwall.api.roof_for)."""
    return api.roof_for(spec, fm, tp, **roof_knobs(args))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("roofline", help="FLOPs, bytes, intensity and time per op and per phase")
    p.add_argument("model")
    p.add_argument("--batch", default="1", help="batch sizes, e.g. 1,8,64 (default 1)")
    p.add_argument("--context", default="4k", help="tokens in the cache at the decode step (default 4k)")
    p.add_argument("--prompt", "--prompt-tokens", dest="prompt", default="2k",
                   help="prompt tokens for prefill / TTFT (default 2k)")
    p.add_argument("--mla", choices=["absorbed", "naive"], help="MLA decode form (default absorbed)")
    p.add_argument("--micro-batches", type=whole(1, 1 << 16), metavar="M",
                   help="with --pp: the decode batch split into M micro-batches in flight (default: pp)")
    p.add_argument("--ops", action="store_true", help="print every op of every layer, not one row per op kind")
    p.add_argument("--plot", metavar="PNG", help="write a roofline chart (ops as points under the roof)")
    common.add_model_knobs(p)
    common.add_parallel(p)
    add_roof_args(p)
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_roofline)

    p = sub.add_parser("speed", help="TTFT and decode speed vs context, model against model")
    p.add_argument("models", nargs="+")
    p.add_argument("--context", default="1k,4k,16k,64k,128k,512k", help="contexts (default 1k..512k)")
    p.add_argument("--prompt", "--prompt-tokens", dest="prompt", default="2k",
                   help="prompt tokens for TTFT (default 2k)")
    p.add_argument("--batch", type=whole(1), default=1)
    p.add_argument("--plot", metavar="PNG", help="decode time per token vs context, one line per model")
    common.add_model_knobs(p)
    common.add_parallel(p, auto=True)
    add_roof_args(p)
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_speed)

    p = sub.add_parser("speculate", help="speculative decoding: expected tokens per target pass and speed-up")
    p.add_argument("model", help="target model")
    p.add_argument("--draft", required=True, help="draft model")
    p.add_argument("--acceptance", type=real(0, 1), default=0.7, help="per-token acceptance rate (default 0.7)")
    p.add_argument("--k", default="1,2,3,4,5,6,8,10,12,16", help="drafted tokens per pass to try")
    p.add_argument("--context", default="4k")
    p.add_argument("--batch", type=whole(1), default=1)
    common.add_model_knobs(p)
    add_roof_args(p)
    common.add_json(p)
    common.refuse_empty(p)
    p.set_defaults(func=cmd_speculate)


# -- roofline ----------------------------------------------------------------------

def cmd_roofline(args) -> int:
    r = api.roofline(args.model, batch=args.batch, context=args.context, prompt_tokens=args.prompt, mla=args.mla,
                     micro_batches=args.micro_batches, plot=args.plot, **common.model_knobs(args),
                     **common.parallel_sizes(args), **roof_knobs(args))
    data = r.to_dict()
    phases = [{**p, "prefill": pt.prefill, "decode": pt.decode} for p, pt in zip(data["phases"], r.points)]
    return common.emit(args, data, lambda data: _print_roofline(data, phases, r.roof, args))


def _print_roofline(data, phases, roof: Roof, args) -> None:
    """The phases, serving speed and decode ops as tables, then the compute-bound batch and the ceiling."""
    c = console()
    a = data["assumptions"]
    par = f", {data['parallel']}" if data["gpus"] > 1 else ""
    c.print(f"[bold]{data['model']}[/bold] on {roof.device.name}{par}: weights {data['formats']['weights']}, "
            f"KV {data['formats']['kv']}; prompt {fmt_tokens(data['prompt'])}, decode at context "
            f"{fmt_tokens(data['context'])}")
    c.print(f"mode: {data['mode_text']}")
    balance = a["machine_balance"]
    c.print(f"roof: {_flop_rate(a['peak_flops'])} {a['compute_dtype']} x{a['compute_eff']:.3g}, "
            f"{a['bandwidth_Bps'] / 1e9:,.0f} GB/s x{a['mem_eff']:g}{_op_bandwidths(a)} -> balance "
            f"{f'{balance:,.0f}' if balance >= 10 else f'{balance:.3g}'} FLOP/B"
            + (f"; MLA decode {a['mla_decode']}" if a["mla_decode"] else ""))
    for p in phases:
        if not p["fits"]:
            c.print(f"[bold]warning:[/bold] {p['fit_reason']}")
    rows = []
    for p in phases:
        for ph in (p["prefill"], p["decode"]):
            rows.append([ph.name, p["batch"], _ms(ph.time_s), f"{ph.flops / 1e9:,.1f}", fmt_bytes(ph.bytes),
                         f"{ph.intensity:,.1f}", ph.bound])
    c.print(table(f"per phase ({data['mode']})", ["phase", "batch", "time", "GFLOP", "bytes", "FLOP/B", "bound"], rows))
    rows = []
    for p in phases:
        e = p["energy_per_token"]["joules"]
        rows.append([p["batch"], _ms(p["ttft_s"]), _ms(p["tpot_s"]), f"{p['tokens_per_s_per_seq']:,.1f}",
                     f"{p['tokens_per_s_total']:,.0f}", f"{e * 1e3:,.2f} mJ" if e else "-"])
    c.print(table(f"serving ({data['mode']})",
                  ["batch", "TTFT", "time/token", "tok/s per seq", "tok/s total", "energy/token*"], rows,
                  caption="* estimate: DRAM bytes x pJ/byte of the memory type + FLOPs x TDP/peak, capped at TDP x "
                          "time (sources: kvwall/catalog/energy.json)"))
    ops = group_ops(phases[0]["decode"].per_op) if not args.ops else phases[0]["decode"].per_op
    c.print(table(f"decode ops, batch {phases[0]['batch']} (summed over layers)" if not args.ops else "decode ops",
                  ["op", "n", "GFLOP", "bytes", "FLOP/B", "time", "bound"],
                  [[o["name"] if not args.ops else f"{o['layer']}: {o['name']}", o.get("count", 1),
                    f"{o['flops'] / 1e9:,.2f}", fmt_bytes(o["bytes"]),
                    f"{o['intensity']:,.1f}" if o["intensity"] not in (None, float("inf")) else "-",
                    _ms(o["time_s"]), o["bound"]] for o in ops]))
    wb, sb = data["compute_bound_batch_weights"], data["compute_bound_batch_step"]
    c.print(f"decode turns compute-bound: weight matmuls at batch {wb if wb else 'above 65536'}; the whole step "
            + (f"at batch {sb}" if sb else "never (attention over the cache stays memory-bound at any batch)"))
    for p in data["phases"]:
        pd = p.get("pipelined_decode")
        if pd and "skipped" not in pd:
            c.print(f"pipeline, batch {p['batch']} in {pd['micro_batches']} micro-batches of {pd['micro_batch']}: "
                    f"kept full across steps, {_ms(pd['steady_tpot_s'])}/token, {pd['steady_tok_s']:,.0f} tok/s "
                    f"(stages idle {pd['steady_idle']:.0%}); one step alone {_ms(pd['time_s'])} (fill and drain, "
                    f"bubble {pd['bubble']:.0%}); the batch through the stages in turn {_ms(p['decode']['time_s'])}")
        elif pd:
            c.print(f"pipeline, batch {p['batch']}: {pd['skipped']}")
    ceil = data["throughput_ceiling"]
    if ceil:
        c.print(f"throughput ceiling at {fmt_tokens(data['context'])} (cache fills the memory, 10% reserve): "
                f"batch {ceil['batch']:,} -> {ceil['tokens_per_s_total']:,.0f} tok/s, {_ms(ceil['tpot_s'])}/token")
    else:
        c.print("throughput ceiling: weights (or one sequence's cache) do not fit one GPU's memory")
    if args.plot:
        c.print(f"roofline chart written to {args.plot}")
    for note in data["notes"]:
        c.print(f"note: {note}")


def _flop_rate(flops: float) -> str:
    """TFLOP/s for a GPU, GFLOP/s below 1 TFLOP/s (a CPU's bf16 GEMM here: 1.2 GFLOP/s, once printed as 0 TFLOP/s)."""
    return f"{flops / 1e12:,.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.3g} GFLOP/s"


def _op_bandwidths(a: dict) -> str:
    """The bandwidth each kind of op streams at, and the fixed cost per layer, where the roof has them."""
    bw = a.get("op_bandwidth_Bps") or {}
    parts = [f"{k} {v / 1e9:,.0f} GB/s" for k, v in bw.items()]
    if a.get("layer_overhead_s"):
        parts.append(f"{a['layer_overhead_s'] * 1e6:,.1f} us per layer")
    return f" ({', '.join(parts)})" if parts else ""


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms" if s < 1 else f"{s:,.2f} s"


# -- speed -------------------------------------------------------------------------

def cmd_speed(args) -> int:
    r = api.speed(args.models, context=args.context, prompt_tokens=args.prompt, batch=args.batch, plot=args.plot,
                  **common.model_knobs(args), **common.parallel_sizes(args), **roof_knobs(args))
    return common.emit(args, r.to_dict(), _print_speed)


GROUP = api.GROUP  # a point's parallel sizes, as its cell names them


def _cell(text: str, r: dict) -> str:
    if not r["fits"]:
        return text + " (!)"
    group = " ".join(f"{k} {r[k]}" for k in GROUP if r[k] > 1)
    return text + (f" ({group})" if group else "")


def _print_speed(data: dict) -> None:
    out, prompt = data["models"], data["prompt"]
    contexts = [r["context"] for r in out[0]["decode"]]
    rows = [[m["model"], m["family"],
             _cell(_ms(m["ttft_s"]), {"fits": m["ttft_fits"], **{k: m[f"ttft_{k}"] for k in GROUP}}),
             *[_cell(f"{r['tokens_per_s']:,.1f}", r) for r in m["decode"]]] for m in out]
    console().print(table(
        f"decode tok/s per sequence on {data['device']} (batch {data['batch']}; "
        f"TTFT for a {fmt_tokens(prompt)} prompt)",
        ["model", "family", "TTFT", *[f"@{fmt_tokens(c)}" for c in contexts]], rows,
        caption=f"{data['mode_text']}; contexts past a "
                "model's trained maximum are what-ifs; (tp N): on the smallest group of N GPUs that holds the "
                "weights and the batch's cache (10% reserve), --tp/--pp to fix it; (!) does not fit, a what-if"))
    for note in common.weights_notes(out):
        console().print(f"note: {note}")
    for m in out:
        if m["fit_warning"]:
            console().print(f"[bold]warning:[/bold] {m['fit_warning']}")
        for note in m["notes"]:
            console().print(f"note: {note}")
    if data.get("plot"):
        console().print(f"plot written to {data['plot']}")


# -- speculate ---------------------------------------------------------------------

def cmd_speculate(args) -> int:
    if not 0 <= args.acceptance <= 1:
        raise KvwallError(f"--acceptance {args.acceptance}: must be between 0 and 1")
    target, fm_t, notes = common.model_and_formats(args.model, args)
    draft, fm_d, _ = common.model_and_formats(args.draft, args)
    _check_shared_vocab(target, draft)
    roof = roof_from(args, target, fm_t)
    ctx = parse_tokens(args.context, "context")
    ks = parse_int_list(args.k, "k")
    rows = speculative(target, draft, ctx, ks, args.acceptance, fm_t, fm_d, roof, args.batch)
    best = max(rows, key=lambda r: r["speedup"])
    # both models on one GPU (speculate models no parallelism): the target's weights and cache, the draft's weights
    draft_weights = total_weight_bytes(draft, fm_d.weights)
    warning = fit_warning(target, roof.device.memory_bytes, Parallel(1), batch=args.batch, context=ctx,
                          formats=fm_t, device=roof.device.name, beside=(f"{draft.name}'s weights", draft_weights),
                          fix="a smaller --weight-format or --kv-format, a smaller draft, or a bigger --device")
    data = {"target": target.name, "draft": draft.name, "acceptance": args.acceptance, "context": ctx,
            "batch": args.batch, "device": roof.device.name, "rows": rows, "best_k": best["k"], "fit_warning": warning,
            "formula": "E[tokens] = (1 - a^(k+1)) / (1 - a); speed-up = E x t_target / (k t_draft + t_verify(k+1))",
            "mode": roof.mode, "mode_text": describe(roof), "assumptions": roof.assumptions()}
    return common.emit(args, data, _print_speculate)


# vocabularies this close are one tokenizer padded apart (Qwen3-8B 151,936 beside Qwen2.5-7B 152,064)
VOCAB_SLACK = 0.01


def _check_shared_vocab(target, draft) -> None:
    """A draft proposes token ids the target verifies: they must share a tokenizer. Sizes more than 1 % apart
    cannot (GPT-2's 50,257 tokens beside Llama 3's 128,256); equal sizes are taken on trust."""
    a, b = target.vocab, draft.vocab
    if abs(a - b) > VOCAB_SLACK * max(a, b):
        raise KvwallError(f"--draft {draft.name}: its vocabulary ({b:,} tokens) is not {target.name}'s ({a:,}); a "
                          "draft must share the target's tokenizer: pick one from the target's family")


def _print_speculate(data: dict) -> None:
    rows, best = data["rows"], max(data["rows"], key=lambda r: r["speedup"])
    c = console()
    c.print(f"[bold]{data['target']}[/bold] drafted by [bold]{data['draft']}[/bold] on {data['device']}, acceptance "
            f"{data['acceptance']:g}, context {fmt_tokens(data['context'])}, batch {data['batch']}")
    c.print(f"mode: {data['mode_text']} (the target's roof times the draft too)")
    c.print(table(f"speculative decoding ({data['mode']})",
                  ["k", "E[tokens]/pass", "draft", "verify", "time/token", "speed-up"],
                  [[r["k"], f"{r['expected_tokens']:.2f}", _ms(r["draft_s"]), _ms(r["verify_s"]),
                    _ms(r["time_per_token_s"]), f"{r['speedup']:.2f}x"] for r in rows],
                  caption=data["formula"] + " (Leviathan et al. 2023)"))
    c.print(_speculate_verdict(rows, best))
    if data["fit_warning"]:
        c.print(f"[bold]warning:[/bold] {data['fit_warning']}")


def _speculate_verdict(rows: list[dict], best: dict) -> str:
    """One line: the best k and what the k's tried say beyond it (never more than they show)."""
    if best["speedup"] < 1:
        return f"no k tried pays (best {best['speedup']:.2f}x at k = {best['k']}): decode without a draft"
    head = f"best k = {best['k']} ({best['speedup']:.2f}x); "
    if best["k"] == max(r["k"] for r in rows):
        return head + "the largest k tried: a larger one may pay more"
    losing = [r["k"] for r in rows if r["speedup"] < 1]
    return head + (f"stops paying (speed-up < 1) at k = {losing[0]}" if losing else
                   f"every k tried pays; past k = {best['k']} extra drafts cost more than they add")
