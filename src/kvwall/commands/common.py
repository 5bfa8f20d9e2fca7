"""Options shared by the predictor's commands: model, what-if knobs, formats, parallelism, device."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from kvwall.errors import KvwallError
from kvwall.predict.memory import Formats, Parallel
from kvwall.report.tables import print_json
from kvwall.spec.formats import ENGINE_WEIGHTS, engine_weights
from kvwall.spec.model import ModelSpec
from kvwall.spec.resolve import load_spec
from kvwall.units import parse_token_list, parse_tokens, tokens_arg, whole


def need_torch(what: str) -> None:
    """One line, exit 2, when the engine's torch is not installed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise KvwallError(f"{what}: pip install 'kvwall[engine]'") from None


def add_model_knobs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what-if (re-shape the model without editing its config)")
    g.add_argument("--kv-heads", type=whole(1), metavar="N", help="every attention layer gets N KV heads (1 = MQA)")
    g.add_argument("--window", type=tokens_arg, metavar="N", help="sliding window of N tokens on every attention layer")
    f = p.add_argument_group("storage formats")
    f.add_argument("--weight-format", metavar="F", help="weights: bf16, fp16, fp8, int8, int4[:g128], nvfp4, ...")
    f.add_argument("--kv-format", metavar="F", help="KV cache: bf16, fp8, int8, int4, int2, nvfp4, ...")
    f.add_argument("--state-format", metavar="F", help="SSM state (default: the model's 16-bit type)")


def weights_arg(text: str) -> str:
    """A `--weights` value the engine holds (kvwall.spec.formats.engine_weights), else argparse's one-line error."""
    try:
        engine_weights(text)
    except KvwallError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def weights_list_arg(text: str) -> list[str]:
    """Comma-separated `--weights` values, each checked."""
    return [weights_arg(t.strip()) for t in text.split(",") if t.strip()] or [weights_arg(text)]


def add_weights(p: argparse.ArgumentParser, many: bool = False) -> None:
    """The engine's --weights: how it holds the projection matrices (the predictor's --weight-format strings)."""
    p.add_argument("--weights", type=weights_list_arg if many else weights_arg, default=None,
                   metavar="LIST" if many else "W",
                   help=f"{'comma-separated: ' if many else ''}engine weights: {ENGINE_WEIGHTS}; int formats keep "
                        "projections packed (activations in --dtype); default: the checkpoint's values in --dtype")


def add_parallel(p: argparse.ArgumentParser, auto: bool = False) -> None:
    """--tp / --pp; with `auto`, leaving both out means: the smallest tensor-parallel group that fits."""
    default = "the smallest of 1, 2, 4, 8 on which the model and its cache fit" if auto else "1"
    p.add_argument("--tp", type=whole(1, 1 << 16), default=None if auto else 1, metavar="N",
                   help=f"tensor-parallel GPUs (default {default})")
    p.add_argument("--pp", type=whole(1, 1 << 16), default=None if auto else 1, metavar="N",
                   help="pipeline-parallel stages (default 1)")
    p.add_argument("--ep", type=whole(1, 1 << 16), default=None if auto else 1, metavar="N",
                   help="expert parallel over N GPUs per stage: each holds the non-expert weights and serves 1/N "
                        "of the batch, the routed experts split whole over them, all-to-all per MoE layer "
                        "(default 1; not with --tp)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (all sizes in bytes) instead of a table")


def emit(args: argparse.Namespace, data: Any, render: Callable[[Any], int | None]) -> int:
    """The one way a command prints its result: JSON with --json, else ``render(data)``'s tables.

    Returns the exit status: 0, or what ``render`` returns (`fit` says 1 when the weights do not fit)."""
    if getattr(args, "json", False):
        print_json(data)
        return 0
    return render(data) or 0


def reshape(spec: ModelSpec, args: argparse.Namespace) -> tuple[ModelSpec, list[str]]:
    """Apply --kv-heads / --window; return the new spec and what was changed, in words."""
    notes = []
    if getattr(args, "kv_heads", None) is not None:
        n = args.kv_heads
        heads = {l.mixer.n_q_heads for l in spec.layers if l.mixer is not None and l.mixer.kind == "attention"}
        if not heads:
            raise KvwallError(f"--kv-heads: {spec.name} has no (non-latent) attention layers to re-shape")
        if n <= 0 or any(h % n for h in heads):
            raise KvwallError(f"--kv-heads {n}: must divide the query heads ({', '.join(map(str, sorted(heads)))})")
        spec = spec.with_kv_heads(n)
        notes.append(f"re-shaped: every attention layer has {n} KV heads")
    if getattr(args, "window", None) is not None:
        w = parse_tokens(args.window, "window")
        if not spec.has("attention"):
            raise KvwallError(f"--window: {spec.name} has no (non-latent) attention layers to give a window")
        asked = max(parse_token_list(args.context, "context")) if getattr(args, "context", None) else 0
        if w >= max(spec.max_context or 0, asked) > 0:  # contexts past the maximum are what-ifs, where it slides
            what = (f"{spec.name}'s maximum context {spec.max_context}" if (spec.max_context or 0) >= asked
                    else f"the longest --context asked for ({asked})")
            raise KvwallError(f"--window {w} is not shorter than {what}; such a window never slides: "
                              "pick a smaller one")
        spec = spec.with_window(w)
        notes.append(f"re-shaped: every attention layer has a sliding window of {w} tokens")
    return spec, notes


def model_and_formats(arg: str, args: argparse.Namespace) -> tuple[ModelSpec, Formats, list[str]]:
    spec, notes = reshape(load_spec(arg), args)
    fm = Formats.for_spec(spec, args.weight_format, args.kv_format, args.state_format)
    return spec, fm, notes


def parallel(args: argparse.Namespace) -> Parallel:
    return Parallel(*(getattr(args, k, None) or 1 for k in ("tp", "pp", "ep")))


def auto_parallel(args: argparse.Namespace) -> bool:
    """None of --tp, --pp, --ep given: each point runs on the smallest tensor-parallel group that fits."""
    return all(getattr(args, k, 1) is None for k in ("tp", "pp", "ep"))
