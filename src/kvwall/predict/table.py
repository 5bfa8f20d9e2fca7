"""A published-measurement row (catalog/measurements.json) as the ops to time, and its predicted figure under
any roof. The ops of a row do not depend on the roof, so they are counted once (identical ops of different
layers grouped with a count) and re-timed cheaply for every roof the fit tries.

Conventions (``CONVENTIONS``, stated in every ``kvwall validate`` output):
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvwall.errors import KvwallError
from kvwall.predict.devices import Device, get_device
from kvwall.predict.memory import Formats
from kvwall.predict.ops import step_ops
from kvwall.predict.roofline import Roof, step_overhead, weights_kernel
from kvwall.predict.step import Op, Step
from kvwall.spec.model import ModelSpec
from kvwall.spec.resolve import load_spec

TIME_METRICS = ("tpot_s", "ttft_s")  # compared as rates: 1 / time
CONVENTIONS = {
    "compute_dtype": "bf16, fp8 when the weight format is fp8",
    "decode_context": "prompt + output / 2 tokens (the middle of the generation)",
    "throughput": "replicas x batch x output / (TTFT + output x TPOT); replicas = n_devices / tp",
    "error": "predicted rate / measured rate - 1; TPOT and TTFT compared as 1 / time; positive = prediction faster",
}
__doc__ += "".join(f"\n* {k}: {v}" for k, v in CONVENTIONS.items()) + "\n"


@dataclass
class Prepared:
    row: dict
    spec: ModelSpec
    fm: Formats
    device: Device
    dtype: str
    context: int
    decode: list[tuple[Op, int]] | None  # (op, how many layers have it), or None when the metric needs no decode
    prefill: list[tuple[Op, int]] | None


def skip_reason(row: dict) -> str | None:
    if row.get("batch") is None:
        return "batch not fixed by the benchmark (a server-style run): no batch to predict at"
    if row["n_devices"] % row["tp"]:
        return f"{row['n_devices']} devices do not split into tp={row['tp']} groups"
    if not row["value"] > 0:
        return f"measured value {row['value']!r} is not a positive figure"
    return None


def prepare(row: dict) -> Prepared:
    """The row's model, formats, device and grouped ops (decode at the middle of the generation, prefill)."""
    spec = load_spec(row["model"])
    fm = Formats.for_spec(spec, row["weight_format"], row["kv_format"])
    batch, metric, tp = row["batch"], row["metric"], row["tp"]
    context = max(1, row["prompt_tokens"] + row["output_tokens"] // 2)
    dec = pre = None
    if metric in ("decode_tok_s_per_seq", "tpot_s", "throughput_tok_s"):
        dec = _grouped(step_ops(spec, Step(batch, context - 1, 1), fm, tp))
    if metric in ("ttft_s", "throughput_tok_s"):
        pre = _grouped(step_ops(spec, Step(batch, 0, row["prompt_tokens"]), fm, tp))
    if dec is None and pre is None:
        raise KvwallError(f"row {row['id']!r}: unknown metric {metric!r}")
    dtype = "fp8" if fm.weights.name == "fp8" else "bf16"
    return Prepared(row, spec, fm, get_device(row["device"]), dtype, context, dec, pre)


def _grouped(ops: list[Op]) -> list[tuple[Op, int]]:
    """Ops that time the same on any roof, once each with their count."""
    key = lambda o: (o.kind, o.kernel, bool(o.cache_read), o.flops, o.bytes, o.link_bytes)  # noqa: E731
    counts = Counter(key(o) for o in ops)
    first = {}
    for o in ops:
        first.setdefault(key(o), o)
    return [(first[k], n) for k, n in counts.items()]


def phase_time(prep: Prepared, ops: list[tuple[Op, int]], roof: Roof, is_prefill: bool) -> float:
    """What run_step (and prefill) give for these ops: fixed costs + the sum of each op's time."""
    t = step_overhead(prep.spec, roof.device, weights_kernel([op for op, _ in ops]), decode=not is_prefill)
    t += sum(n * roof.op_time(op) for op, n in ops)
    return t + roof.prefill_overhead_s if is_prefill else t


def figures(prep: Prepared, roof: Roof) -> dict:
    """TTFT / TPOT as needed, the predicted figure in the metric's unit and its error against the row."""
    row, out = prep.row, {}
    if prep.decode is not None:  # and the engine's runner per sequence, where the roof has one (HOST_COSTS)
        out["tpot_s"] = phase_time(prep, prep.decode, roof, False) + roof.device.runner_time(row["batch"])
    if prep.prefill is not None:
        out["ttft_s"] = phase_time(prep, prep.prefill, roof, True)
    out["predicted"] = _figure(row, out)
    out["error"] = rate(row["metric"], out["predicted"]) / rate(row["metric"], row["value"]) - 1
    return out


def _figure(row: dict, t: dict) -> float:
    """The predicted figure in the metric's own unit, from the predicted TTFT and TPOT."""
    metric = row["metric"]
    if metric == "decode_tok_s_per_seq":
        return 1 / t["tpot_s"]
    if metric in TIME_METRICS:
        return t[metric]
    replicas, out = row["n_devices"] // row["tp"], row["output_tokens"]
    return replicas * row["batch"] * out / (t["ttft_s"] + out * t["tpot_s"])


def rate(metric: str, value: float) -> float:
    return 1 / value if metric in TIME_METRICS else value
