"""Accelerators: the catalog (data in ``catalog/devices.json``), this machine's profile, or a bare memory size."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.files import home
from kvwall.spec.validate import real_problem

# Compute dtypes a peak can be asked for. A 16- or 32-bit dtype without its own peak takes its same-width
# twin's (fp16 on a chip that lists only bf16), then fp32's (a profile that measured only fp32 matmuls).
# A narrower dtype (fp8, int8, fp4) never borrows a wider one's peak: that would print, say, V100's fp16
# peak labelled fp4. Such a request is refused instead.
COMPUTE_DTYPES = ("bf16", "fp16", "fp32", "tf32", "fp8", "int8", "fp4")
_TWINS = {"fp16": "bf16", "bf16": "fp16", "tf32": "fp32"}
_WIDE = ("bf16", "fp16", "fp32", "tf32")


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s, sustained main-memory read (datasheet peak for catalog devices)
    peak_flops: dict = field(default_factory=dict)  # dtype -> dense FLOP/s
    interconnect_bw: float | None = None  # bytes/s per direction, per device
    onchip_cache_bytes: int | None = None
    tdp_w: float | None = None
    memory_tech: str | None = None
    year: int | None = None
    vendor: str = ""
    source: str = ""
    unconfirmed: tuple = ()
    notes: tuple = ()
    layer_overhead_s: float = 0.0  # fixed dispatch cost per layer per step (measured for `local`; 0 in the catalog)
    op_bandwidth: dict = field(default_factory=dict)  # op class ("matmul", "attention") -> reachable bytes/s
    mixer_overhead_s: dict = field(default_factory=dict)  # per-layer dispatch cost by mixer kind, where it differs
    step_overhead_s: float | None = None  # dispatch cost per step outside the layers (None: one layer's worth)
    # measured for `local` only (empty in the catalog), see Roof.op_time:
    op_flops: dict = field(default_factory=dict)  # kernel -> FLOP/s of its arithmetic, paid on top of its bytes
    op_fixed_s: dict = field(default_factory=dict)  # kernel -> fixed seconds per call beyond bytes and FLOPs
    matmul_rows: dict = field(default_factory=dict)  # matmul rows M -> weight bytes/s reached at M rows
    prefill_attention: dict = field(default_factory=dict)  # prompt tokens T -> FLOP/s of prefill attention at T
    packed_rows: dict = field(default_factory=dict)  # "matmul:int4" / "matmul:int8" -> {rows M -> weight bytes/s}
    packed_overhead_s: dict = field(default_factory=dict)  # "matmul:int4" ... -> per attention block, weights packed
    # the figures above are for decode steps the engine runs through its fused decode stack
    # (engine/decode_stack.py); a step it runs layer by layer (a prefill chunk, a mixed step) pays this much more
    # per attention block (measured for `local`; 0 in the catalog)
    unfused_overhead_s: float = 0.0
    # kvwall serve's paged pool per attention layer per forward, beyond a contiguous cache: {"fixed_s",
    # "s_per_byte"} of the bytes it gathers (measure.overhead.paged_pool_cost); empty: not charged
    paged_pool: dict = field(default_factory=dict)
    # and what it adds per step beyond the forwards (runner, streaming to clients): {"fixed_s", "per_row_s",
    # "slowdown": a fraction of the forwards' time} (overhead.runner_step_cost)
    runner_step: dict = field(default_factory=dict)

    def runner_time(self, rows: int, forward_s: float = 0.0) -> float:
        """What the engine's runner adds to a step of `rows` sequences beyond its forwards (runner_step): fixed
        + per row + slowdown x the step's `forward_s`; 0 for a step of no rows or where nothing was measured."""
        cost = self.runner_step
        if not cost or not rows:
            return 0.0
        return cost.get("fixed_s", 0.0) + cost.get("per_row_s", 0.0) * rows + cost.get("slowdown", 0.0) * forward_s

    def layer_overhead(self, kind: str | None, weights_kernel: str = "", fused: bool = True) -> float:
        """Fixed cost per layer of this mixer kind; an attention block whose projections run a packed kernel
        (`weights_kernel`, "matmul:int4" ...) at the cost measured for that path, where it was; one not in a fused
        decode step (`fused` False) pays unfused_overhead_s more."""
        extra = 0.0 if fused or kind != "attention" else self.unfused_overhead_s
        if kind == "attention" and weights_kernel in self.packed_overhead_s:
            return self.packed_overhead_s[weights_kernel] + extra
        return self.mixer_overhead_s.get(kind or "", self.layer_overhead_s) + extra

    def flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for a compute dtype (or its same-width twin; fp32 for a 16-bit dtype)."""
        candidates = (dtype, _TWINS.get(dtype), "fp32" if dtype in _WIDE else None)
        for d in candidates:
            if d and self.peak_flops.get(d):
                return float(self.peak_flops[d])
        listed = ", ".join(k for k, v in self.peak_flops.items() if v) or "none"
        raise KvwallError(f"device {self.name!r} lists no {dtype} compute peak (it lists: {listed}); pass "
                          "--compute-dtype with one of those, or a device that lists it")

    def balance(self, dtype: str = "bf16") -> float:
        """Machine balance: FLOPs per byte of memory traffic at which compute and bandwidth take equal time."""
        return self.flops(dtype) / self.bandwidth

    def as_dict(self) -> dict:
        return {
            "name": self.name, "vendor": self.vendor, "year": self.year, "memory_bytes": self.memory_bytes,
            "memory_bandwidth_Bps": self.bandwidth, "peak_flops": dict(self.peak_flops),
            "interconnect_per_direction_Bps": self.interconnect_bw, "onchip_cache_bytes": self.onchip_cache_bytes,
            "tdp_W": self.tdp_w, "memory_tech": self.memory_tech, "source": self.source,
            "unconfirmed": list(self.unconfirmed), "notes": list(self.notes),
        }


def _from_entry(name: str, e: dict) -> Device:
    link = e.get("interconnect") or {}
    per_dir = link.get("per_direction_Bps") or (link.get("bandwidth_Bps") or 0) / 2 or None
    return Device(
        name=name, memory_bytes=int(e["memory_bytes"]), bandwidth=float(e["memory_bandwidth_Bps"]),
        peak_flops={k: v for k, v in (e.get("peak_flops") or {}).items() if v},
        interconnect_bw=per_dir, onchip_cache_bytes=e.get("onchip_cache_bytes"), tdp_w=e.get("tdp_W"),
        memory_tech=e.get("memory_tech"), year=e.get("year"), vendor=e.get("vendor", ""),
        source=e.get("source", ""), unconfirmed=tuple(e.get("unconfirmed", ())), notes=tuple(e.get("notes", ())),
        layer_overhead_s=float(e.get("layer_overhead_s") or 0.0),
        op_bandwidth={k: float(v) for k, v in (e.get("op_bandwidth_Bps") or {}).items() if v},
        mixer_overhead_s={k: float(v) for k, v in (e.get("mixer_overhead_s") or {}).items()},
        step_overhead_s=e.get("step_overhead_s"),
        op_flops={k: float(v) for k, v in (e.get("op_flops") or {}).items() if v},
        op_fixed_s={k: float(v) for k, v in (e.get("op_fixed_s") or {}).items()},
        matmul_rows=_rows_table(e.get("matmul_rows_Bps")),
        prefill_attention=_rows_table(e.get("prefill_attention_flops")),
        packed_rows={f: _rows_table(t) for f, t in (e.get("packed_rows_Bps") or {}).items()},
        packed_overhead_s={k: float(v) for k, v in (e.get("packed_overhead_s") or {}).items()},
        unfused_overhead_s=float(e.get("unfused_overhead_s") or 0.0),
        paged_pool={k: float(v) for k, v in (e.get("paged_pool") or {}).items()},
        runner_step={k: float(v) for k, v in (e.get("runner_step") or {}).items()},
    )


def _rows_table(table: dict | None) -> dict[int, float]:
    """{"1": bytes/s, "16": ...} -> {1: ..., 16: ...} in row order (a profile's JSON keys are strings)."""
    return {int(k): float(v) for k, v in sorted((table or {}).items(), key=lambda kv: int(kv[0])) if v}


def device_names() -> list[str]:
    return list(catalog.devices_table())


_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "h200-sxm": "h200", "4090": "rtx-4090", "cpu": "cpu-generic",
            "a100-80gb-sxm": "a100-80gb", "a100-40gb-sxm": "a100-40gb", "v100": "v100-sxm"}


def profile_path() -> Path:
    return home() / "local-device.json"


def get_device(name: str) -> Device:
    key = name.strip().lower()
    if key == "local":
        return local_device()
    table = catalog.devices_table()
    key = _ALIASES.get(key, key)
    if key not in table:
        raise KvwallError(f"unknown device {name!r}; known: {', '.join(table)}, local (after `kvwall calibrate`)")
    return _from_entry(key, table[key])


def local_device() -> Device:
    """This machine's profile ($KVWALL_HOME/local-device.json, written by `kvwall calibrate`), every figure checked
    here (_profile_problem): the one place every command that reads a profile goes through."""
    path = profile_path()
    if not path.is_file():
        raise KvwallError(f"no profile of this machine at {path}; run `kvwall calibrate` first")
    try:
        entry = json.loads(path.read_bytes().decode("utf-8"))
        problem = _profile_problem(entry)
        if problem is None:
            return _from_entry("local", entry)
    except (ValueError, KeyError, TypeError, RecursionError, OSError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    raise KvwallError(f"the local profile at {path} cannot be used: {problem}; run `kvwall calibrate` again")


# The plausible range of a profile's figure, by its unit: (lowest, highest). A figure outside it is a broken
# measurement or a hand edit gone wrong (1e-300 FLOP/s made 1e300-second steps, 1e300 B/s NaN), refused where a
# profile is loaded. Wide on purpose: a slow but real machine must pass.
PLAUSIBLE = {
    # 1 MB/s: 1,000x below the slowest engine rate calibrate has measured (matmul weights at 256 rows, 7.2e8 B/s
    # on a 2-core EPYC VM: benchmarks/results/validate_serving_profile_1903.json); 1e14: 13x B200's 7.7e12
    "B/s": (1e6, 1e14),
    # 1 MFLOP/s: 1,000x below the slowest GEMM measured (bf16 on that CPU, which lacks bf16 units: 1.1e9);
    # 1e17: 11x B200's dense fp4 peak (9e15)
    "FLOP/s": (1e6, 1e17),
    # a fixed cost (per layer, step, call or row): up to 1 s, 600x the largest measured (1.7 ms per Mamba2 block)
    "s": (0.0, 1.0),
    # the serving pool's seconds per byte gathered: up to the inverse of the lowest "B/s" (measured 1.3-2.4e-11)
    "s/B": (0.0, 1e-6),
    # memory: 1 MB holds no language model; 1 PB is 20x the largest single machine's (48 TB of shared memory)
    "bytes": (1e6, 1e15),
    # a last-level cache: 0 (none reported) to 1 TB, 4,000x MI300X's 256 MB Infinity Cache
    "cache bytes": (0.0, 1e12),
    # the runner's slowdown of the forwards, a share of their time: measured 0 to 0.15; 10 = 11x slower forwards
    "share": (0.0, 10.0),
    # board power: 0.1 W (a phone SoC at rest) to 100 kW (100x a B200's 1 kW)
    "W": (0.1, 1e5),
}
# Every figure a profile may hold -> its unit in PLAUSIBLE. "table.*": each entry of that table without a line of
# its own; "table.*.*": each entry of each inner table. Absent or null: not checked, except REQUIRED and a null
# inside a table (the predictor cannot read it) but in NULLABLE's, where null means "none" (no fp8 peak, no link).
FIGURES = {
    "memory_bytes": "bytes", "memory_bandwidth_Bps": "B/s", "onchip_cache_bytes": "cache bytes", "tdp_W": "W",
    "interconnect.*": "B/s", "layer_overhead_s": "s", "step_overhead_s": "s", "unfused_overhead_s": "s",
    "peak_flops.*": "FLOP/s", "op_bandwidth_Bps.*": "B/s", "mixer_overhead_s.*": "s", "op_flops.*": "FLOP/s",
    "op_fixed_s.*": "s", "matmul_rows_Bps.*": "B/s", "prefill_attention_flops.*": "FLOP/s",
    "packed_rows_Bps.*.*": "B/s", "packed_overhead_s.*": "s",
    "paged_pool.*": "s", "paged_pool.s_per_byte": "s/B", "runner_step.*": "s", "runner_step.slowdown": "share",
}
REQUIRED = ("memory_bytes", "memory_bandwidth_Bps")
ROW_TABLES = ("matmul_rows_Bps", "prefill_attention_flops", "packed_rows_Bps.*")  # keyed by a row / token count
NULLABLE = ("peak_flops", "interconnect")
_TEXT = ("interconnect.name",)  # entries of those tables that are not figures


def _profile_problem(e: object) -> str | None:
    """What makes a profile unusable or implausible (None: nothing): every figure in FIGURES a finite number
    within its unit's PLAUSIBLE range, the tables objects, and a compute peak to time math with."""
    if not isinstance(e, dict):
        return f"it holds a JSON {type(e).__name__}, not an object"
    figures = [(key, key, e.get(key)) for key in REQUIRED]  # (name, line of FIGURES, value)
    for key in dict.fromkeys(p.split(".")[0] for p in FIGURES):  # each top-level key once, in FIGURES' order
        if key not in REQUIRED and e.get(key) is not None:
            depth = max(p.count(".") for p in FIGURES if p.split(".")[0] == key)
            problem = _collect(key, key, e[key], depth, figures)
            if problem:
                return problem
    if not any(v for v in (e.get("peak_flops") or {}).values()):
        return "'peak_flops' lists no compute peak (a profile times math with them)"
    for name, line, value in figures:
        unit = FIGURES[line]
        lo, hi = PLAUSIBLE[unit]
        problem = real_problem(value, above_zero=lo > 0)
        if problem:
            return f"{name!r} is {value!r:.40}: {problem}"
        if not lo <= value <= hi:
            return f"{name!r} is {value:.3g}, outside the plausible {lo:g} to {hi:g} ({unit})"
    return None


def _collect(name: str, pattern: str, value: object, depth: int, out: list) -> str | None:
    """Add (name, its line of FIGURES, value) of every figure in ``value``, a table ``depth`` levels deep (0: a
    figure), to ``out``; or say which table is not an object, or has a key that is not a row count where it must."""
    if depth == 0:
        out.append((name, pattern, value))
        return None
    if not isinstance(value, dict):
        return f"{name!r} is {value!r:.40}, not an object" + (" of objects" if depth > 1 else "")
    if depth == 1 and pattern in ROW_TABLES:
        bad = [k for k in value if not str(k).isdigit() or int(k) < 1]
        if bad:
            return f"{name!r} has a key {bad[0]!r}, not a row count >= 1"
    for k, v in value.items():
        entry = f"{pattern}.{k}"
        if entry in _TEXT or (v is None and pattern in NULLABLE):
            continue
        problem = _collect(f"{name}.{k}", entry if entry in FIGURES else f"{pattern}.*", v, depth - 1, out)
        if problem:
            return problem
    return None


def memory_only(memory_bytes: int) -> Device:
    """A device known only by its memory size (for `fit --memory 80GB`)."""
    return Device(name=f"{memory_bytes / 1e9:g} GB", memory_bytes=memory_bytes, bandwidth=float("nan"))


TREND = ["v100-sxm", "a100-80gb", "h100-sxm", "h200", "b200"]  # one device per NVIDIA generation


def balance_trend(names: list[str] = TREND) -> list[dict]:
    """Across generations: 16-bit tensor peak (bf16, or fp16 on V100) vs bandwidth, growth relative to the first."""
    rows = []
    for name in names:
        d = get_device(name)
        rows.append({"device": name, "year": d.year, "flops": d.flops("bf16"), "bandwidth": d.bandwidth,
                     "balance": d.balance("bf16")})
    for r in rows:
        r["flops_growth"] = r["flops"] / rows[0]["flops"]
        r["bandwidth_growth"] = r["bandwidth"] / rows[0]["bandwidth"]
    return rows
