"""The ideal roofline against published measurements (catalog/measurements.json), row by row.

Conventions, stated in every output (``CONVENTIONS``):

* each row is predicted on the ideal roofline (efficiency 1.0, no fixed costs) with the row's weight and
  KV formats, tensor parallel ``tp``, and bf16 math (fp8 math when the weights are fp8);
* one decode step is timed at context prompt + output / 2 (the middle of the generation);
* throughput = replicas x batch x output / (TTFT + output x TPOT), TTFT = the prefill of the whole batch,
  replicas = n_devices / tp (data-parallel copies);
* error = predicted rate / measured rate - 1, where a time (TPOT, TTFT) is compared as its rate 1 / time:
  positive = the prediction is faster than the measurement.
"""

from __future__ import annotations

import statistics

from kvwall.errors import KvwallError
from kvwall.predict.devices import get_device
from kvwall.predict.memory import Formats, Parallel
from kvwall.predict.roofline import Roof, decode, prefill
from kvwall.spec.resolve import load_spec

TIME_METRICS = ("tpot_s", "ttft_s")  # compared as rates: 1 / time
CONVENTIONS = {
    "mode": "ideal roofline (efficiency 1.0, no per-step fixed cost)",
    "compute_dtype": "bf16, fp8 when the weight format is fp8",
    "decode_context": "prompt + output / 2 tokens (the middle of the generation)",
    "throughput": "replicas x batch x output / (TTFT + output x TPOT); replicas = n_devices / tp",
    "error": "predicted rate / measured rate - 1; TPOT and TTFT compared as 1 / time; positive = prediction faster",
}


def select(rows, engine: str | None = None, device: str | None = None) -> list[dict]:
    """The rows of one engine and/or device (case-insensitive); an unknown name is a one-line error."""
    out = list(rows)
    for key, want in (("engine", engine), ("device", device)):
        if want is None:
            continue
        known = sorted({r[key] for r in out}, key=str.lower)
        if want.lower() not in {k.lower() for k in known}:
            raise KvwallError(f"no measurements for {key} {want!r}; known: {', '.join(known) or 'none'}")
        out = [r for r in out if r[key].lower() == want.lower()]
    return out


def predict_row(row: dict) -> dict:
    """The ideal roofline's figure for the row's metric, or a skip with its reason."""
    base = {k: row[k] for k in ("id", "model", "device", "n_devices", "tp", "engine", "metric")}
    base["measured"] = row["value"]
    reason = _skip_reason(row)
    if reason is None:
        try:
            return base | _predict(row)
        except KvwallError as exc:
            reason = str(exc)
    return base | {"skipped": reason}


def _skip_reason(row: dict) -> str | None:
    if row.get("batch") is None:
        return "batch not fixed by the benchmark (a server-style run): no batch to predict at"
    if row["n_devices"] % row["tp"]:
        return f"{row['n_devices']} devices do not split into tp={row['tp']} groups"
    if not row["value"] > 0:
        return f"measured value {row['value']!r} is not a positive figure"
    return None


def _predict(row: dict) -> dict:
    spec = load_spec(row["model"])
    fm = Formats.for_spec(spec, row["weight_format"], row["kv_format"])
    roof = Roof(get_device(row["device"]), "fp8" if fm.weights.name == "fp8" else "bf16")
    par, batch, metric = Parallel(row["tp"]), row["batch"], row["metric"]
    context = max(1, row["prompt_tokens"] + row["output_tokens"] // 2)
    out = {"batch": batch, "compute_dtype": roof.dtype, "decode_context": context}
    if metric in ("decode_tok_s_per_seq", "tpot_s", "throughput_tok_s"):
        out["tpot_s"] = decode(spec, context, batch, fm, roof, par).time_s
    if metric in ("ttft_s", "throughput_tok_s"):
        out["ttft_s"] = prefill(spec, row["prompt_tokens"], batch, fm, roof, par).time_s
    out["predicted"] = _figure(row, out)
    out["error"] = _rate(metric, out["predicted"]) / _rate(metric, row["value"]) - 1
    return out


def _figure(row: dict, t: dict) -> float:
    """The predicted figure in the metric's own unit, from the predicted TTFT and TPOT."""
    metric = row["metric"]
    if metric == "decode_tok_s_per_seq":
        return 1 / t["tpot_s"]
    if metric in TIME_METRICS:
        return t[metric]
    if metric == "throughput_tok_s":
        replicas = row["n_devices"] // row["tp"]
        out = row["output_tokens"]
        return replicas * row["batch"] * out / (t["ttft_s"] + out * t["tpot_s"])
    raise KvwallError(f"row {row['id']!r}: unknown metric {metric!r}")


def _rate(metric: str, value: float) -> float:
    return 1 / value if metric in TIME_METRICS else value


def summarize(results: list[dict]) -> dict:
    """Counts, and median / max |error| overall, per engine and per device (skipped rows only counted)."""
    done = [r for r in results if "error" in r]
    return {"checked": len(done), "skipped": len(results) - len(done), "all": _stats(done),
            "engines": _grouped(done, "engine"), "devices": _grouped(done, "device")}


def _grouped(done: list[dict], key: str) -> dict:
    names = sorted({r[key] for r in done}, key=str.lower)
    return {n: _stats([r for r in done if r[key] == n]) for n in names}


def _stats(done: list[dict]) -> dict:
    if not done:
        return {"n": 0, "median_abs_error": None, "median_error": None, "max_abs_error": None, "worst": None}
    worst = max(done, key=lambda r: abs(r["error"]))
    return {"n": len(done), "median_abs_error": statistics.median(abs(r["error"]) for r in done),
            "median_error": statistics.median(r["error"] for r in done),
            "max_abs_error": abs(worst["error"]), "worst": worst["id"]}


def validate(rows, engine: str | None = None, device: str | None = None) -> dict:
    """Every selected row predicted, and the summary."""
    results = [predict_row(r) for r in select(rows, engine, device)]
    return {"conventions": CONVENTIONS, "rows": results, "summary": summarize(results)}
