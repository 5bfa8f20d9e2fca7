"""`kvwall bench`: run each architecture on this machine and hold the roofline prediction against it.

Each architecture runs in its own process (kvwall.measure.bench_worker); this module plans the
points, skips the ones that would not fit in memory, adds the prediction for the same point from
the roofline on the `local` device profile, and computes the error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

from kvwall.errors import KvwallError
from kvwall.measure.archs import Arch
from kvwall.predict.devices import Device
from kvwall.predict.formats import get_format
from kvwall.engine.caches.registry import predicted_bytes
from kvwall.predict.memory import Formats
from kvwall.predict.roofline import Roof, decode, prefill
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import ModelSpec

GOAL = 0.20  # prediction error allowed where decode is bandwidth-bound


@dataclass
class Plan:
    archs: list[Arch]
    contexts: list[int]
    steps: int = 8
    warmup: int = 2
    prefill_max: int = 4096
    threads: int | None = None
    skipped: list[dict] = field(default_factory=list)


def arch_spec(arch: Arch) -> ModelSpec:
    return spec_from_config(arch.config, name=arch.name, where=f"bench arch {arch.name}")


def formats_for(arch: Arch) -> Formats:
    fp32 = get_format("fp32")
    return Formats(fp32, get_format(arch.kv_format), fp32)


def predicted_cache_bytes(arch: Arch, spec: ModelSpec, context: int) -> int:
    """The cache registry's figure for the arch's cache, in fp32 (the worker's dtype) with default knobs."""
    return predicted_bytes(arch.cache, spec, batch=1, tokens=context, element="fp32")


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def plan_points(plan: Plan) -> dict[str, list[int]]:
    """Contexts each architecture runs; the rest go to plan.skipped with the reason."""
    avail = available_memory()
    out = {}
    for arch in plan.archs:
        name = arch.name
        spec = arch_spec(arch)
        weights = spec.params() * 4
        keep = []
        for ctx in plan.contexts:
            need = weights + predicted_cache_bytes(arch, spec, ctx) * 2 + (1 << 30)  # fill/dequant copies + runtime
            if spec.max_context and ctx + plan.steps + plan.warmup >= spec.max_context:
                plan.skipped.append({"arch": name, "context": ctx, "reason": "past the model's maximum context"})
            elif need > avail:
                plan.skipped.append({"arch": name, "context": ctx,
                                     "reason": f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"})
            else:
                keep.append(ctx)
        out[name] = keep
    return out


def predict(arch: Arch, spec: ModelSpec, context: int, device: Device, prefill_max: int, held: int) -> dict:
    """The roofline's figures for one point; `held` is the tokens the cache holds when its bytes are read."""
    roof = Roof(device, dtype="fp32")
    fm = formats_for(arch)
    d = decode(spec, context, 1, fm, roof)
    out = {"decode_pred_s": d.time_s, "decode_bound": d.bound, "decode_bytes": d.bytes, "decode_flops": d.flops,
           "cache_pred_bytes": predicted_cache_bytes(arch, spec, held)}
    if context <= prefill_max:
        p = prefill(spec, context, 1, fm, roof)
        out.update(prefill_pred_s=p.time_s, prefill_bound=p.bound)
    return out


def run(plan: Plan, device: Device, on_point: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every planned point; each result carries its measurement, prediction and error."""
    points = plan_points(plan)
    results = []
    for arch in plan.archs:
        name, contexts = arch.name, points[arch.name]
        if not contexts:
            continue
        spec = arch_spec(arch)
        job = {"name": name, "config": arch.config, "cache": arch.cache, "contexts": contexts, "steps": plan.steps,
               "warmup": plan.warmup, "prefill_max": plan.prefill_max, "threads": plan.threads,
               "checkpoint": arch.checkpoint}
        for line in _worker(job):
            if "error" in line:
                plan.skipped.append({"arch": name, "context": None, "reason": line["error"]})
                continue
            held = line["context"] + plan.warmup + plan.steps  # the cache's bytes are read after the decode steps
            line.update(predict(arch, spec, line["context"], device, plan.prefill_max, held))
            line["decode_error"] = line["decode_pred_s"] / line["decode_s"] - 1
            if line.get("prefill_s") and line.get("prefill_pred_s"):
                line["prefill_error"] = line["prefill_pred_s"] / line["prefill_s"] - 1
            line["within_goal"] = abs(line["decode_error"]) <= GOAL
            results.append(line)
            if on_point:
                on_point(line)
    return results


def _worker(job: dict):
    proc = subprocess.Popen([sys.executable, "-m", "kvwall.measure.bench_worker", json.dumps(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for raw in proc.stdout:
        if raw.startswith("{"):
            yield json.loads(raw)
    proc.wait()
    if proc.returncode:
        err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()
        raise KvwallError(f"the benchmark of {job['name']} failed: {err[-1] if err else 'no message'}")


def summary(results: list[dict], archs: list[Arch] | None = None) -> dict:
    bw = [r for r in results if r["decode_bound"] == "memory"]
    within = [r for r in bw if r["within_goal"]]
    gaps = {a.name: a.gap for a in archs or []}
    outside = [r["arch"] for r in bw if not r["within_goal"]]
    return {"points": len(results), "bandwidth_bound_points": len(bw), "within_goal": len(within),
            "goal": GOAL, "max_abs_error_bandwidth_bound": max((abs(r["decode_error"]) for r in bw), default=None),
            "outside_goal": [f"{r['arch']}@{r['context']}" for r in bw if not r["within_goal"]],
            "reasons": {a: gaps.get(a) or "not investigated" for a in dict.fromkeys(outside)}}
