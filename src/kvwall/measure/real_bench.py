"""`kvwall bench MODEL` for a real model: decode tok/s at batch 1 and 16, kvwall with each cache next to
transformers on the same weights (one process, steps interleaved: kvwall.measure.real_worker), and the
roofline's prediction for each point on the `local` profile.

Only ratios measured in the same run mean much on a shared machine; each row carries the median step and
every timed step, and `vs_transformers` is kvwall's tok/s over transformers' at the same batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvwall.engine.caches.registry import CACHE_NAMES, parse_cache
from kvwall.errors import KvwallError
from kvwall.measure.archs import Arch
from kvwall.predict.devices import Device
from kvwall.predict.memory import Formats
from kvwall.predict.roofline import Roof, decode
from kvwall.spec.formats import Format, engine_weights, get_format
from kvwall.spec.gguf_meta import read_meta, weight_format
from kvwall.spec.hf import spec_from_config

BATCHES = (1, 16)
PROMPT = 16  # tokens of the (random, fixed-seed) prompt, as in the measurement


@dataclass
class RealPlan:
    archs: list[Arch]
    caches: list[str] = field(default_factory=lambda: list(CACHE_NAMES))
    batches: tuple[int, ...] = BATCHES
    prompt: int = PROMPT
    steps: int = 8
    warmup: int = 2
    threads: int | None = None
    transformers: bool = True
    weights: list[str] = field(default_factory=lambda: ["fp32"])  # --weights: one kvwall engine per format
    skipped: list[dict] = field(default_factory=list)


def kv_format(cache: str) -> str:
    """The predictor's KV format of a cache: its quantized format, fp8, or the fp32 the engine computes in."""
    choice = parse_cache(cache)
    return choice.format or ("fp8" if choice.name == "fp8" else "fp32")


def held_format(arch: Arch, weights: str) -> Format:
    """The predictor's format of what an fp32 engine holds under --weights: packed projections (native: the
    file's own types, gguf_meta.weight_format) with the token table and head in fp32 unless packed too."""
    fmt = engine_weights(weights)
    if fmt is None:
        if not str(arch.checkpoint).lower().endswith(".gguf"):
            raise KvwallError(f"--weights native keeps a .gguf file's own blocks; {arch.name} is not a .gguf: use "
                              "int8 or int4")
        text = weight_format(read_meta(arch.checkpoint))
        if text is None:
            raise KvwallError(f"{arch.name}: its file mixes weight types, so --weights native has no single "
                              "predictor format; use int8 or int4")
        fmt = get_format(text, head_ok=True)
    return fmt if fmt.head is not None or fmt.is_float() else replace(fmt, head=get_format("fp32"))


def predict(arch: Arch, cache: str, batch: int, context: int, device: Device, weights: str = "fp32") -> dict:
    """The roofline's decode step on the local profile: the weights as the engine holds them (fp32
    activations), the cache's KV format."""
    spec = spec_from_config(arch.config, name=arch.name, where=arch.checkpoint or arch.name)
    fp32 = get_format("fp32")
    spec = spec if parse_cache(cache).name == "sliding" else spec.with_window(None)  # others keep every token
    fm = Formats(held_format(arch, weights), get_format(kv_format(cache)), fp32)
    d = decode(spec, context, batch, fm, Roof(device, dtype="fp32"))
    return {"pred_step_s": d.time_s, "pred_tok_s": batch / d.time_s, "pred_bound": d.bound, "pred_bytes": d.bytes}


def run(plan: RealPlan, device: Device, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Every real model at every batch: kvwall's caches and transformers, with predictions and ratios."""
    rows = []
    for arch in plan.archs:  # a --weights the predictor cannot name fails here, before any model runs
        for w in plan.weights:
            held_format(arch, w)
    for arch in plan.archs:
        job = {"name": arch.name, "checkpoint": arch.checkpoint, "caches": plan.caches, "batches": list(plan.batches),
               "prompt": plan.prompt, "steps": plan.steps, "warmup": plan.warmup, "threads": plan.threads,
               "transformers": plan.transformers, "weights": plan.weights}
        got = []
        for line in _worker(job):
            if "error" in line:
                plan.skipped.append({"arch": arch.name, "context": None, "reason": line["error"]})
                continue
            if line["cache"] is not None:  # the middle of the timed steps: what the cache holds on average
                context = plan.prompt + plan.warmup + (plan.steps + 1) // 2
                line.update(predict(arch, line["cache"], line["batch"], context, device, line["weights"]))
                line["pred_error"] = line["pred_step_s"] / line["step_s"] - 1
            got.append(line)
            if on_row:
                on_row(line)
        rows += with_ratios(got)
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each kvwall row gets vs_transformers: its tok/s over transformers' at the same model and batch."""
    ref = {(r["arch"], r["batch"]): r["tok_s"] for r in rows if r["engine"] == "transformers"}
    for r in rows:
        base = ref.get((r["arch"], r["batch"]))
        r["vs_transformers"] = r["tok_s"] / base if base and r["engine"] != "transformers" else None
    return rows


def _worker(job: dict):
    from kvwall.measure.bench import _worker as run_job

    return run_job(job, "kvwall.measure.real_worker")


def summary(rows: list[dict]) -> dict:
    """Per model, weights and batch: kvwall's contiguous cache against transformers (the targets of issue 12)."""
    out = {}
    for r in rows:
        if r["cache"] == "contiguous" and r["vs_transformers"] is not None:
            out[f"{r['arch']}:{r['weights']}@{r['batch']}"] = round(r["vs_transformers"], 3)
    return {"contiguous_vs_transformers": out}
