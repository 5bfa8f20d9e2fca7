"""`kvwall bench`: run each architecture on this machine and hold the roofline prediction against it.

Each architecture runs in its own process (kvwall.measure.bench_worker); this module plans the
points, skips the ones that would not fit in memory, adds the prediction for the same point from
the roofline on the `local` device profile, and computes the error.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwall.engine.caches.registry import as_stored, predicted_bytes
from kvwall.errors import KvwallError
from kvwall.measure import machine
from kvwall.measure.archs import Arch
from kvwall.predict import mixers
from kvwall.predict.devices import Device
from kvwall.predict.memory import Formats
from kvwall.predict.roofline import Roof, decode, fused_stack, prefill, weights_kernel
from kvwall.predict.step import MATMUL, Step
from kvwall.spec.formats import get_format
from kvwall.spec.hf import spec_from_config
from kvwall.spec.model import ModelSpec
from kvwall.units import fmt_bytes, fmt_tokens

GOAL = 0.20  # prediction error allowed where decode is bandwidth-bound
BUSY_SHARE = 0.10  # an architecture's timings are busy when other processes took more of the CPUs meanwhile
CONSTANT_GAP = 0.25  # a gap that changes across contexts by less than this share of its mean is a fixed cost


@dataclass
class Plan:
    archs: list[Arch]
    contexts: list[int]
    steps: int = 8
    warmup: int = 2
    profile_steps: int = 4  # after the timed steps, steps timed per part (bench_worker.timed_parts): the reason
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
    cached = predicted_cache_bytes(arch, spec, held)
    spec = as_stored(spec, fm.kv)  # as the engine's cache holds it: a DSA indexer key in the cache's format
    d = decode(spec, context, 1, fm, roof)
    out = {"decode_pred_s": d.time_s, "decode_bound": d.bound, "decode_bytes": d.bytes, "decode_flops": d.flops,
           "cache_pred_bytes": cached, "parts_pred": predicted_parts(spec, d, fm, roof)}
    reads = [op for op in d.ops if op.cache_read]
    if reads:  # the bandwidth the profile gives this architecture's cache reads
        out["cache_read_pred_Bps"] = roof.op_bandwidth(reads[0])
    if context <= prefill_max:
        p = prefill(spec, context, 1, fm, roof)
        out.update(prefill_pred_s=p.time_s, prefill_bound=p.bound)
    return out


def _part() -> dict:
    return dict(layers=0, pred_s=0.0, overhead_s=0.0, weight_s=0.0, weight_bytes=0.0, read_bytes=0.0)


def predicted_parts(spec: ModelSpec, d, fm: Formats, roof: Roof) -> dict[str, dict]:
    """The predicted decode step `d` split as bench_worker.timed_parts times it: per part ("mixer:<kind>",
    "ffn:<kind>", "rest") its layers, the seconds of its ops (weight_s: of its matmuls) and of its share of the
    fixed dispatch cost (a layer's goes to its mixer, the step's own to the rest), and its bytes: weights, and the
    cache or state it reads and writes. A layer's ops are its mixer's, then its channel mixer's
    (predict.ops.layer_ops on one GPU)."""
    parts: dict[str, dict] = {}

    def add(key: str, ops: list[dict]) -> dict:
        p = parts.setdefault(key, _part())
        for op in ops:
            p["pred_s"] += op["time_s"]
            p["weight_s"] += op["time_s"] if op["kind"] == MATMUL else 0.0
            p["weight_bytes"] += op["weight_bytes"]
            p["read_bytes"] += op["cache_read"] + op["cache_write"] + op["state_bytes"]
        return p

    fused, kernel, st = fused_stack(spec), weights_kernel(d.ops), Step(1, d.step.past, 1)
    for i, layer in enumerate(spec.layers):
        mine = [op for op in d.per_op if op["layer"] == i]
        n_ffn = len(mixers.of(layer.ffn).ops(i, layer.ffn, spec, st, fm, 1, 1)) if layer.ffn is not None else 0
        if layer.mixer is not None:
            p = add(f"mixer:{layer.mixer.kind}", mine[:len(mine) - n_ffn])
            cost = roof.device.layer_overhead(layer.mixer.kind, kernel, fused)  # measured per mixer kind
            p["layers"] += 1
            p["overhead_s"] += cost
            p["pred_s"] += cost
        if layer.ffn is not None:
            add(f"ffn:{layer.ffn.kind}", mine[len(mine) - n_ffn:])["layers"] += 1
    rest = add("rest", [op for op in d.per_op if op["layer"] is None])
    own = d.overhead_s - sum(p["overhead_s"] for p in parts.values())  # the step's own fixed cost
    rest["overhead_s"] += own
    rest["pred_s"] += own
    return parts


def parts_table(measured: dict, predicted: dict, device: Device) -> list[dict]:
    """Each part of the step measured beside its prediction, and the speed it reached on its bytes: with its
    matmuls and dispatch as predicted, a part's cache or state traffic took the rest of its measured time
    (read_Bps; share_of_calibrated: its share of the calibrated read bandwidth); a part that reads none streamed
    its weights at weight_Bps in its time less its dispatch."""
    rows = []
    for part, p in predicted.items():
        if part not in measured:
            continue
        row = {"part": part, "layers": p["layers"], "measured_s": measured[part], **p}
        if p["read_bytes"]:
            left = measured[part] - p["weight_s"] - p["overhead_s"]
            row["read_Bps"] = p["read_bytes"] / left if left > 0 else None
        elif p["weight_bytes"]:
            left = measured[part] - p["overhead_s"]
            row["weight_Bps"] = p["weight_bytes"] / left if left > 0 else None
        speed = row.get("read_Bps") or row.get("weight_Bps")
        row["share_of_calibrated"] = speed / device.bandwidth if speed else None
        rows.append(row)
    return rows


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
               "checkpoint": arch.checkpoint, "profile_steps": plan.profile_steps}
        watch = machine.OthersWatch(children=True)  # the worker's own CPU time is ours
        lines = []
        for line in _worker(job):
            if "error" in line:
                plan.skipped.append({"arch": name, "context": None, "reason": line["error"]})
                continue
            # the cache's bytes are read after the decode steps, the profiled ones included
            held = line["context"] + plan.warmup + plan.steps + plan.profile_steps
            line.update(predict(arch, spec, line["context"], device, plan.prefill_max, held))
            line["decode_error"] = line["decode_pred_s"] / line["decode_s"] - 1
            if line.get("prefill_s") and line.get("prefill_pred_s"):
                line["prefill_error"] = line["prefill_pred_s"] / line["prefill_s"] - 1
            line["within_goal"] = abs(line["decode_error"]) <= GOAL
            if line.get("parts_s") and line.get("parts_pred"):
                line["parts"] = parts_table(line["parts_s"], line["parts_pred"], device)
            lines.append(line)
            results.append(line)
            if on_point:
                on_point(line)
        # the worker has exited, so its CPU time counts as ours: a run beside another process's work reads
        # its timings 1.5-15x slower here (a serving benchmark beside it: 4k int8 decode 484 ms, 30 ms quiet)
        share = watch.share(os.cpu_count() or 1)
        for line in lines:
            line["others_cpu_share"] = round(share, 3)
    return results


PROCESS_S = 4.0  # one worker's start: python, torch, building the model (about 3-5 s on the 2-core machine)


def estimate_seconds(plan: Plan, device: Device) -> float:
    """A rough wall time for the plan, from the roofline on this machine's profile: each worker's start, and
    per point its prefill (counted twice: measured prefill runs 1.4-2.3x the prediction here) and its
    warm-up, timed and profiled decode steps."""
    total = 0.0
    for arch in plan.archs:
        spec = arch_spec(arch)
        total += PROCESS_S
        for ctx in plan.contexts:
            p = predict(arch, spec, ctx, device, plan.prefill_max, ctx)
            total += 2 * p.get("prefill_pred_s", 0.0) + (plan.warmup + plan.steps + plan.profile_steps) * \
                p["decode_pred_s"]
    return total


def _worker(job: dict, module: str = "kvwall.measure.bench_worker"):
    """Run one job in a fresh process (its own memory high-water mark, no state carried over); yield each JSON line
    it prints; a failed process is a one-line error naming the job. A job's "threads" also goes to the child's
    OMP_NUM_THREADS, so that any OpenMP pool besides torch's is sized alike (the child sets torch's itself)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])} if job.get("threads") else None
    proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for raw in proc.stdout:
        if raw.startswith("{"):
            yield json.loads(raw)
    proc.wait()
    if proc.returncode:
        err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()
        raise KvwallError(f"the benchmark of {job['name']} failed: {err[-1] if err else 'no message'}")


def summary(results: list[dict]) -> dict:
    """Counts against the goal, and for each architecture outside it a reason taken from this run's own points."""
    bw = [r for r in results if r["decode_bound"] == "memory"]
    within = [r for r in bw if r["within_goal"]]
    outside = [r["arch"] for r in bw if not r["within_goal"]]
    busy = sorted({r["arch"] for r in results if r.get("others_cpu_share", 0.0) > BUSY_SHARE})
    return {"points": len(results), "bandwidth_bound_points": len(bw), "within_goal": len(within),
            "others_cpu_share_max": max((r.get("others_cpu_share", 0.0) for r in results), default=0.0),
            "busy_archs": busy,
            "goal": GOAL, "max_abs_error_bandwidth_bound": max((abs(r["decode_error"]) for r in bw), default=None),
            "outside_goal": [f"{r['arch']}@{r['context']}" for r in bw if not r["within_goal"]],
            "reasons": {a: explain([r for r in results if r["arch"] == a]) for a in dict.fromkeys(outside)}}


def explain(rows: list[dict]) -> str:
    """Why one architecture's measured decode time parts from the prediction, claiming only what its points show:
    the sign and size of the gap at each context, then (with two contexts or more) whether the gap is a fixed
    per-step cost or changes with the cache bytes read, and then at what speed this run read the cache."""
    rows = sorted(rows, key=lambda r: r["context"])
    text = "measured decode is " + ", ".join(_gap_at(r) for r in rows)
    parts = next((_slowest_part(r) for r in reversed(rows) if r.get("parts")), "")  # the longest context timed
    if len(rows) == 1:
        return text + "; one context cannot tell a fixed per-step cost from a different cache read speed" + parts
    return f"{text}; {_gap_shape(rows)}{parts}"


def _part_name(p: dict) -> str:
    """"mixer:gated_deltanet" -> "the gated_deltanet mixer"; "ffn:mlp" -> "the mlp channel mixer"."""
    which, _, kind = p["part"].partition(":")
    return {"mixer": f"the {kind} mixer", "ffn": f"the {kind} channel mixer"}.get(which, "the rest")


def _slowest_part(r: dict) -> str:
    """The part of the step (bench_worker.timed_parts) furthest over its prediction at r's context, and the speed
    it reached on its own bytes (parts_table)."""
    p = max(r["parts"], key=lambda p: p["measured_s"] - p["pred_s"])
    times = ", ".join(f"{_part_name(q)} {q['measured_s'] / q['pred_s']:.1f}x" for q in r["parts"] if q["pred_s"])
    text = (f"; timed per part at {fmt_tokens(r['context'])} (measured / predicted: {times}), the furthest over is "
            f"{_part_name(p)} ({p['layers']} layers): {p['measured_s'] * 1e3:.1f} ms against "
            f"{p['pred_s'] * 1e3:.1f} ms predicted")
    share = p.get("share_of_calibrated")
    if p.get("read_Bps"):
        text += (f"; with its matmuls ({p['weight_s'] * 1e3:.1f} ms) and dispatch ({p['overhead_s'] * 1e3:.1f} ms) as "
                 f"predicted, its {fmt_bytes(p['read_bytes'])} of cache and state traffic ran at "
                 f"{p['read_Bps'] / 1e9:.2f} GB/s, {share:.2f} of the calibrated read bandwidth")
    elif p.get("weight_Bps"):
        text += (f"; less its dispatch ({p['overhead_s'] * 1e3:.1f} ms) it streamed its "
                 f"{fmt_bytes(p['weight_bytes'])} of weights at {p['weight_Bps'] / 1e9:.2f} GB/s, {share:.2f} of the "
                 "calibrated read bandwidth")
    elif p["read_bytes"] or p["weight_bytes"]:
        text += "; its matmuls and dispatch as predicted already take all of its measured time"
    return text


def _gap_at(r: dict) -> str:
    gap = r["decode_s"] - r["decode_pred_s"]
    word = "slower" if gap > 0 else "faster"
    return f"{abs(gap) * 1e3:.1f} ms {word} than predicted at {fmt_tokens(r['context'])} ({r['decode_error']:+.0%})"


def _gap_shape(rows: list[dict]) -> str:
    gaps = [r["decode_s"] - r["decode_pred_s"] for r in rows]
    mean = statistics.fmean(gaps)
    if max(gaps) - min(gaps) <= CONSTANT_GAP * abs(mean):
        who = "that the profile does not count" if mean > 0 else "that the profile counts but this run did not spend"
        return (f"the gap is about constant across contexts: a fixed cost of about {abs(mean) * 1e3:.1f} ms per "
                f"step {who}")
    nbytes = [r["cache_bytes"] for r in rows]
    if max(nbytes) - min(nbytes) <= 0.01 * max(nbytes):
        return (f"the gap changes with context ({min(gaps) * 1e3:+.1f} to {max(gaps) * 1e3:+.1f} ms) while the cache "
                "bytes read stay the same, so it is no cache read speed; this run cannot say more")
    return _read_speed(rows, nbytes, mean)


def _read_speed(rows: list[dict], nbytes: list[int], mean_gap: float) -> str:
    """The cache read speed this run reached: 1 / the slope of measured decode time against cache bytes read."""
    slope, icept = _fit(nbytes, [r["decode_s"] for r in rows])
    span = f"{fmt_bytes(min(nbytes))} to {fmt_bytes(max(nbytes))}"
    if slope <= 0:
        return f"the gap changes with context but measured time does not grow with the cache bytes read ({span})"
    text = (f"the gap changes with context: from the slope of measured decode time against the cache bytes read "
            f"({span}) this run read the cache at {1 / slope / 1e9:.1f} GB/s")
    profile = rows[0].get("cache_read_pred_Bps")
    if profile:
        text += f", the profile {profile / 1e9:.1f} GB/s"
    pslope, picept = _fit(nbytes, [r["decode_pred_s"] for r in rows])
    fixed = icept - picept  # what is left at zero cache bytes: a fixed per-step part of the gap
    if abs(fixed) > CONSTANT_GAP * abs(mean_gap):
        text += f", plus a fixed {abs(fixed) * 1e3:.1f} ms per step {'more' if fixed > 0 else 'less'} than predicted"
    return text


def _fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares line y = slope * x + intercept."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
    return slope, my - slope * mx


# -- shared by `kvwall bench` and the report's measured section ----------------------

def resolve_archs(names: list[str], quick: bool) -> list[Arch]:
    """Named architectures or model directories; none named: the default (or quick) set."""
    from pathlib import Path

    from kvwall.measure.archs import ARCHS, DEFAULT, QUICK, checkpoint_arch, gguf_arch
    from kvwall.spec.gguf_meta import PACKAGED, gguf_file

    out = []
    for name in names or (QUICK if quick else DEFAULT):
        if name in ARCHS:
            out.append(ARCHS[name])
        elif Path(name).is_dir():
            out.append(checkpoint_arch(name))
        elif gguf_file(name) is not None:  # a real model: a short name of an installed package, or a .gguf
            out.append(gguf_arch(name))
        else:
            raise KvwallError(f"unknown architecture {name!r}; known: {', '.join(ARCHS)}, a real model "
                              f"({', '.join(PACKAGED)}), a .gguf file or a model directory")
    return out


def local_profile(say: Callable[[str], None] | None = None) -> Device:
    """The `local` device, measured again first (quick) when this host has no profile under a day old."""
    from kvwall.measure.calibrate import fresh_profile
    from kvwall.predict.devices import local_device, profile_path

    fresh_profile(profile_path(), say=say)
    return local_device()


def bench_data(plan: Plan, device: Device, results: list[dict], seconds: float) -> dict:
    """What `kvwall bench` prints and saves: the machine, the results, what was skipped, the summary."""
    import platform

    return {"machine": {"host": platform.node(), "cpu_count": os.cpu_count(), "bandwidth_Bps": device.bandwidth,
                        "peak_flops": device.peak_flops, "profile_source": device.source},
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": round(seconds, 1),
            "steps": plan.steps, "results": results, "skipped": plan.skipped, "summary": summary(results)}
