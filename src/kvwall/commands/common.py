"""Options shared by the predictor's commands: model, what-if knobs, formats, parallelism, device."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvwall.errors import KvwallError
from kvwall.predict.memory import Formats
from kvwall.report.tables import print_json
from kvwall.spec.formats import ENGINE_WEIGHTS, engine_weights, get_format
from kvwall.spec.model import ModelSpec
from kvwall.units import nonempty, threads_arg, tokens_arg, whole


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
    f.add_argument("--weight-format", type=format_arg(head_ok=True), metavar="F",
                   help="weights: bf16, fp16, fp8, int8, int4[:g128], nvfp4, ... (default: the checkpoint's "
                        "quantization_config, else its 16-bit type)")
    f.add_argument("--kv-format", type=format_arg(), metavar="F",
                   help="KV cache: bf16, fp8, int8, int4, int2, nvfp4, ...")
    f.add_argument("--state-format", type=format_arg(), metavar="F",
                   help="SSM state (default: the model's 16-bit type)")


def format_arg(head_ok: bool = False) -> Callable[[str], str]:
    """A storage format (kvwall.spec.formats.get_format) checked by the parser, so its error names the option;
    kept as text for Formats.for_spec."""
    def parse(text: str) -> str:
        try:
            get_format(nonempty(text), head_ok=head_ok)
        except KvwallError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    parse.__name__ = "format"
    return parse


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


def add_threads(p: argparse.ArgumentParser) -> None:
    """--threads N|auto of the commands that run the engine (generate, serve); use_threads applies it."""
    p.add_argument("--threads", type=threads_arg, metavar="N|auto",
                   help="torch threads (default: all cores); auto: each decode step on at most all cores, fewer while "
                        "kvwall's threads wait to run beside other busy processes (Linux; kvwall.engine.threads)")


def use_threads(args: argparse.Namespace) -> bool:
    """--threads N: torch's count, set now. Returns whether --threads auto asks for the engine's ThreadGovernor."""
    if isinstance(args.threads, int):
        import torch

        torch.set_num_threads(args.threads)
    return args.threads == "auto"


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


def refuse_empty(p: argparse.ArgumentParser) -> None:
    """Every free-text option of `p` (no type of its own, no choices) refuses '' and blanks (units.nonempty):
    `if args.cache:` would otherwise take an empty value for the default. Call it after the last add_argument."""
    for action in p._actions:
        if action.option_strings and action.nargs != 0 and action.type is None and not action.choices:
            action.type = (lambda text: nonempty(text, default=False)) if action.required else nonempty


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (all sizes in bytes) instead of a table")


def emit(args: argparse.Namespace, data: Any, render: Callable[[Any], int | None]) -> int:
    """The one way a command prints its result: JSON with --json, else ``render(data)``'s tables.

    Returns the exit status: 0, or what ``render`` returns (`fit` says 1 when the weights do not fit)."""
    if getattr(args, "json", False):
        print_json(data)
        return 0
    return render(data) or 0


MODEL_KNOBS = ("kv_heads", "window", "weight_format", "kv_format", "state_format")


def model_knobs(args: argparse.Namespace) -> dict:
    """The what-if and storage-format options (add_model_knobs) as kvwall.api's keyword arguments."""
    return {k: getattr(args, k, None) for k in MODEL_KNOBS}


def parallel_sizes(args: argparse.Namespace) -> dict:
    """--tp / --pp / --ep as kvwall.api's keyword arguments (None: not given, where add_parallel(auto=True))."""
    return {k: getattr(args, k, None) for k in ("tp", "pp", "ep")}


def reshape(spec: ModelSpec, args: argparse.Namespace) -> tuple[ModelSpec, list[str]]:
    """Apply --kv-heads / --window (kvwall.api.reshape); return the new spec and what was changed, in words."""
    from kvwall import api

    return api.reshape(spec, kv_heads=getattr(args, "kv_heads", None), window=getattr(args, "window", None),
                       context=getattr(args, "context", None))


def model_and_formats(arg: str, args: argparse.Namespace) -> tuple[ModelSpec, Formats, list[str]]:
    """The model, re-shaped, with its formats, as kvwall.api.resolve makes them."""
    from kvwall import api

    return api.resolve(arg, context=getattr(args, "context", None), **model_knobs(args))


def weights_notes(models: list[dict]) -> list[str]:
    """'MODEL: weights LABEL' for each model of a table whose weights are in its checkpoint's own format
    (quantization_config) or a --weight-format that overrides it: a table of several models has no header line
    to name them in."""
    return [f"{m['model']}: weights {m['formats']['weights']}" for m in models
            if m["formats"]["weights"].endswith(("from quantization_config)", "from --weight-format)"))]
