"""`kvwall calibrate`: measure this machine and save it as a device profile (`--device local`).

What is measured (median of several runs each; every run is kept in the profile):
  read  — streaming read of a buffer well past the last-level cache: numpy on one core, numpy on every
          core (one slice per thread), torch; the profile's bandwidth is the best median of these.
  copy  — the same buffer copied into a second one (counted as read + write).
  gemv  — y = A x with A as large as the read buffer (decode's shape): FLOP/s and achieved bandwidth.
  gemm  — C = A B, n x n, per dtype (numpy fp32/fp64; torch fp32/bf16/fp16): the profile's peak_flops.
The profile uses the catalog's entry format (catalog/devices.json) plus a "measured" section.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path

from kvwall.errors import KvwallError
from kvwall.files import check_output, refuse_unless_ours, write_text
from kvwall.measure import machine
from kvwall.measure.kernels import GEMM_BUDGET_S

GiB = 2**30
MiB = 2**20
# Pause between steps: OpenBLAS's worker threads keep spinning for a while after a call, and on a
# 2-core machine that halves the next torch kernel (measured here: torch GEMV 16 GB/s right after a
# numpy GEMV, 31 GB/s after a 0.05 s pause).
SETTLE_S, SETTLE_QUICK_S = 0.2, 0.1
BUSY_WARN = 0.10  # redo, then warn, when other processes took more than this share of the CPUs during a step
RETRY_BUDGET_S, RETRY_BUDGET_QUICK_S = 45.0, 8.0  # no redo starts after this long (keeps the run under a minute)


@dataclasses.dataclass(frozen=True)
class Settings:
    quick: bool
    buffer_bytes: int  # streaming buffer (read, copy, GEMV matrix)
    runs: int  # timed runs per bandwidth measurement
    gemm_n: int
    gemm_runs: int
    threads: int
    settle_s: float  # pause before each step

    @staticmethod
    def choose(quick: bool) -> Settings:
        llc = machine.llc_bytes() or 0
        want = 256 * MiB if quick else max(GiB, 2 * llc)  # default: at least twice the last-level cache
        # buffer + copy destination + a bf16 copy of it must fit comfortably in what is free
        room = machine.available_bytes() // 6
        size = max(64 * MiB, min(want, room)) // MiB * MiB
        return Settings(quick=quick, buffer_bytes=size, runs=3 if quick else 9, gemm_n=1024 if quick else 2048,
                        gemm_runs=3 if quick else 7, threads=machine.cpu_count(),
                        settle_s=SETTLE_QUICK_S if quick else SETTLE_S)


@dataclasses.dataclass
class Calibration:
    settings: Settings
    measurements: list = dataclasses.field(default_factory=list)  # [kernels.Measurement]
    info: dict = dataclasses.field(default_factory=dict)  # machine facts
    started: str = ""
    elapsed_s: float = 0.0

    def best(self, kind: str, key: str = "bandwidth"):
        """The measurement of a kind with the highest median bandwidth (or FLOP/s); None if none ran."""
        ms = [m for m in self.measurements if m.kind == kind and getattr(m, key)]
        return max(ms, key=lambda m: getattr(m, key)) if ms else None

    def peak_flops(self) -> dict[str, float]:
        """Best measured GEMM FLOP/s per dtype."""
        out: dict[str, float] = {}
        for m in self.measurements:
            if m.kind == "gemm":
                out[m.dtype] = max(out.get(m.dtype, 0.0), m.flops)
        return out

    def others_cpu(self) -> float:
        """The largest share of the CPUs other processes took during any one measurement."""
        return max([m.others_cpu for m in self.measurements] + [self.info.get("engine_others_cpu", 0.0)])

    def busy_warning(self) -> str | None:
        """One line naming the load when other processes took more than BUSY_WARN of the CPUs during any step,
        else None: the share over the whole run, the busiest step's, and the highest 1-minute load average seen
        (calibrate's own threads count in it: about 1-2 here)."""
        peak = self.others_cpu()
        if peak <= BUSY_WARN:
            return None
        whole, load = self.info.get("others_cpu_share", peak), self.info.get("load_average_max")
        seen = f"up to {peak * 100:.0f} % in one step" + (f"; load average up to {load:.1f} on {self.settings.threads} "
                                                          "CPUs" if load is not None else "")
        return (f"other processes took {whole * 100:.0f} % of the CPUs during calibrate ({seen}); rates may read "
                "low: rerun `kvwall calibrate` on a quiet machine")

    def notes(self) -> list[str]:
        s, llc = self.settings, self.info.get("llc_bytes")
        read, gemv = self.best("read"), self.best("gemv")
        out = [f"memory_bandwidth_Bps: best median sustained streaming read, by {read.method} over a "
               f"{read.size} buffer",
               f"peak_flops: measured dense GEMM rates (n = {s.gemm_n:d}, smaller for a dtype too slow to time at that "
               f"size in {GEMM_BUDGET_S:.0f} s), not datasheet peaks; fp32 is the best of numpy and torch",
               f"best GEMV ({gemv.method}, {gemv.dtype}) reached {gemv.bandwidth / 1e9:.1f} GB/s, "
               f"{gemv.bandwidth / read.bandwidth:.0%} of the streaming read"]
        if llc and s.buffer_bytes < 2 * llc:
            out.append(f"the read buffer ({s.buffer_bytes / MiB:.0f} MiB) is not well past the last-level cache the "
                       f"OS reports ({llc / MiB:.0f} MiB): cache hits may inflate it; run without --quick")
        env = self.info.get("blas", {}).get("env")
        if env:
            out.append("BLAS environment variables were set and change the GEMM/GEMV numbers: "
                       + ", ".join(f"{k}={v}" for k, v in env.items()))
        return out

    def profile(self) -> dict:
        """This machine as a catalog entry (what kvwall.predict.devices reads), plus every raw number."""
        read, copy, gemv = self.best("read"), self.best("copy"), self.best("gemv")
        info = self.info
        return {
            "vendor": info.get("vendor", ""), "arch": info["cpu_model"], "year": None, "kind": "cpu",
            "memory_bytes": info["memory_bytes"], "memory_tech": None,
            "memory_bandwidth_Bps": read.bandwidth,
            "peak_flops": self.peak_flops(),
            "onchip_cache_bytes": info.get("llc_bytes"),
            "interconnect": {"name": "none (this machine alone)", "bandwidth_Bps": None, "per_direction_Bps": None},
            "tdp_W": None, "layer_overhead_s": info.get("layer_overhead_s", 0.0),
            "op_bandwidth_Bps": info.get("op_bandwidth_Bps", {}),
            "step_overhead_s": info.get("step_overhead_s"), "mixer_overhead_s": info.get("mixer_overhead_s", {}),
            "op_flops": info.get("op_flops", {}), "op_fixed_s": info.get("op_fixed_s", {}),
            "matmul_rows_Bps": info.get("matmul_rows_Bps", {}), "packed_rows_Bps": info.get("packed_rows_Bps", {}),
            "prefill_attention_flops": info.get("prefill_attention_flops", {}),
            "packed_overhead_s": info.get("packed_overhead_s", {}),
            "unfused_overhead_s": info.get("unfused_overhead_s", 0.0),
            "paged_pool": info.get("paged_pool", {}), "runner_step": info.get("runner_step", {}),
            "source": f"measured by `kvwall calibrate` on {info['hostname']} at {self.started}",
            "unconfirmed": [], "notes": self.notes(), "busy_warning": self.busy_warning(),
            "measured": {
                "date": self.started, "seconds": round(self.elapsed_s, 2), "quick": self.settings.quick,
                "settings": dataclasses.asdict(self.settings), **info,
                "read_bandwidth_Bps": read.bandwidth, "read_method": read.method,
                "copy_bandwidth_Bps": copy.bandwidth if copy else None, "copy_method": copy.method if copy else None,
                "gemv_bandwidth_Bps": gemv.bandwidth, "gemv_flops": gemv.flops,
                "gemv_method": f"{gemv.method}, {gemv.dtype}", "others_cpu_share_max": round(self.others_cpu(), 3),
                "results": [m.as_dict() for m in self.measurements],
            },
        }


Progress = Callable[[int, int, str, object], None]  # (steps done, steps in all, label, Measurement, seconds or None)


class _Run:
    """What calibrate notes around every step: its seconds, the highest 1-minute load average, and whether the
    machine has shown itself steadily busy (a redo that came back busy too: then no more redos)."""

    def __init__(self, cal: Calibration, total: int, progress: Progress | None):
        self.cal, self.total, self.progress, self.done = cal, total, progress, 0
        self.steady_busy = False
        self.loads = [machine.load_average()]
        cal.info["step_s"] = {}

    def step(self, label: str, fn, *args, **kwargs):
        """Run one step, noting its seconds; the progress callback hears its label before and its result after."""
        if self.progress:
            self.progress(self.done, self.total, label, None)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds = time.perf_counter() - t0
        self.cal.info["step_s"][label] = round(seconds, 2)
        self.loads.append(machine.load_average())
        self.done += 1
        if self.progress:
            self.progress(self.done, self.total, label, out if hasattr(out, "others_cpu") else seconds)
        return out


ENGINE_STEPS = 12  # the engine section's steps below, for the progress bar's total


def calibrate(quick: bool = False, progress: Progress | None = None) -> Calibration:
    """Run every measurement; ``progress`` is told before and after each step."""
    try:
        import numpy as np
    except ImportError:
        raise KvwallError("`kvwall calibrate` needs numpy: pip install numpy (torch too, for its kernels)") from None
    from kvwall.engine.native import build_all

    build_all()  # the engine steps' C++ kernels, missing ones built together (progress on stderr) before any timing
    s = Settings.choose(quick)
    cal = Calibration(settings=s, started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    t0 = time.perf_counter()
    whole = machine.OthersWatch(children=True)  # the engine step's C++ kernel builds (first run) are ours
    cal.info = _machine_info(s)
    has_torch = cal.info["versions"]["torch"] is not None

    buf = np.ones(s.buffer_bytes // 4, dtype=np.float32)  # touched now, so page faults are not timed
    dst = np.empty_like(buf)
    steps = _steps(s, buf, dst, has_torch)
    run = _Run(cal, len(steps) + (ENGINE_STEPS if has_torch else 0), progress)
    deadline = t0 + (RETRY_BUDGET_QUICK_S if quick else RETRY_BUDGET_S)
    for label, kernel in steps:
        cal.measurements.append(run.step(label, _measure_quietly, kernel, s, deadline, run))
    del buf, dst
    if has_torch:
        _engine(cal, s, run)
    cal.info["others_cpu_share"] = round(whole.share(s.threads), 3)  # over the whole run; with the busiest step's
    # share and the highest load average seen, what busy_warning names
    loads = [x for x in run.loads if x is not None]
    cal.info["load_average_max"] = round(max(loads), 2) if loads else None
    cal.elapsed_s = time.perf_counter() - t0
    return cal


def _engine(cal: Calibration, s: Settings, run: _Run) -> None:
    """The engine's op model (kvwall.measure.overhead), ENGINE_STEPS steps, into cal.info."""
    from kvwall.measure import overhead
    from kvwall.predict.devices import _from_entry
    from kvwall.predict.step import MATMUL, PREFILL_ATTENTION

    quick = s.quick
    size = (128 << 20) if quick else (512 << 20)
    # the op model is fitted as a whole (dispatch = measured step - the ops at the rates just measured), so
    # a busy spell skews it silently: a run beside a pip install gave 0 ms per attention block, 14.6 per Mamba
    watch = machine.OthersWatch(children=True)  # a first run compiles the C++ kernels: the compiler is ours
    rows, rows_fixed = run.step("engine: matmul by rows", overhead.matmul_rows_bandwidth, size // 4)  # 4x the LLC
    attention, attention_flops = run.step("engine: decode attention", overhead.attention_rates, size)
    bandwidth = {"matmul": rows[1], "attention": attention}
    prefill = run.step("engine: prefill attention", overhead.prefill_attention_rates)
    flops = {"attention": attention_flops, PREFILL_ATTENTION: prefill[max(prefill)],  # the rate without the table
             "latent": run.step("engine: MLA latent", overhead.latent_rate, attention, size)}
    cal.info["prefill_attention_flops"] = {str(t): v for t, v in prefill.items()}
    fixed = {MATMUL: rows_fixed}
    for f in ("int8", "int4", "int2"):
        bandwidth[f"attention:{f}"], fixed[f"attention:{f}"] = run.step(
            f"engine: {f} cache attention", overhead.quantized_attention_rates, f, size)
    cal.info["op_bandwidth_Bps"] = bandwidth
    cal.info["op_flops"] = {k: v for k, v in flops.items() if v}
    cal.info["op_fixed_s"] = fixed
    cal.info["matmul_rows_Bps"] = {str(m): v for m, v in rows.items()}
    packed, packed_fixed = run.step("engine: packed matmul", overhead.packed_rates, size // 4)
    cal.info["packed_rows_Bps"] = {f: {str(m): v for m, v in t.items()} for f, t in packed.items()}
    fixed.update(packed_fixed)
    rates = _from_entry("local", cal.profile())  # the rates just measured, for the op model
    steps = 20 if quick else 30
    costs, paired = run.step("engine: dispatch per block", overhead.engine_overheads, rates, steps=steps,
                             total_bytes=size // 4)
    # the 1-row matmul rate and cost per call timed beside the attention blocks' steps replace the sweep's: the
    # block cost is fitted against them (overhead._paired_rounds says why)
    rows[1] = bandwidth["matmul"] = paired["rate"]
    fixed[MATMUL] = paired["fixed"]
    cal.info["matmul_rows_Bps"] = {str(m): v for m, v in rows.items()}
    rates = _from_entry("local", cal.profile())
    cal.info["layer_overhead_s"] = costs["attention"]
    cal.info["step_overhead_s"] = costs["step"]
    cal.info["unfused_overhead_s"] = costs["unfused"]
    cal.info["mixer_overhead_s"] = {k: v for k, v in costs.items() if k not in ("attention", "step", "unfused")}
    cal.info["packed_overhead_s"] = run.step("engine: packed block dispatch", overhead.packed_layer_overheads,
                                             rates, steps=steps)
    # kvwall serve's pool and its runner around the forward, charged by `simulate`
    cal.info["paged_pool"] = run.step("engine: serving pool", overhead.paged_pool_cost)
    cal.info["runner_step"] = run.step("engine: serving runner", overhead.runner_step_cost)
    cal.info["engine_others_cpu"] = watch.share(s.threads)


def _steps(s: Settings, buf, dst, has_torch: bool) -> list[tuple[str, Callable]]:
    """(label, measurement) for every kernel, in order: read, copy, GEMV, GEMM."""
    from kvwall.measure import kernels as k

    mat = buf.reshape(-1, 4096)  # (rows, 4096) fp32, the same bytes as the read buffer
    n, runs, threads = s.gemm_n, s.runs, s.threads
    steps = [("read: numpy, 1 thread", lambda: k.read_numpy(buf, runs))]
    if threads > 1:
        steps.append((f"read: numpy, {threads} threads", lambda: k.read_numpy_threads(buf, threads, runs)))
    if has_torch:
        steps.append(("read: torch", lambda: k.read_torch(buf, threads, runs)))
    steps.append(("copy: numpy, 1 thread", lambda: k.copy_numpy(buf, dst, runs)))
    if threads > 1:
        steps.append((f"copy: numpy, {threads} threads", lambda: k.copy_numpy_threads(buf, dst, threads, runs)))
    if has_torch:
        steps.append(("copy: torch", lambda: k.copy_torch(buf, dst, threads, runs)))
    steps.append(("gemv: numpy fp32", lambda: k.gemv_numpy(mat, runs)))
    if has_torch:
        steps += [(f"gemv: torch {d}", lambda d=d: k.gemv_torch(mat, d, threads, runs)) for d in ("fp32", "bf16")]
    steps += [(f"gemm: numpy {d}", lambda d=d: k.gemm_numpy(n, d, s.gemm_runs)) for d in ("fp32", "fp64")]
    if has_torch:
        steps += [(f"gemm: torch {d}", lambda d=d: k.gemm_torch(n, d, threads, s.gemm_runs))
                  for d in ("fp32", "bf16", "fp16")]
    return steps


def _measure_quietly(kernel, s: Settings, deadline: float, run: _Run):
    """Measure; if other processes took part of the machine, wait and measure again (twice at most, only before
    the deadline, and only until a redo comes back busy too); keep the quietest attempt. Under load 6 on the
    2 cores every redo came back as busy (67 %) and the first four steps took 9-13 s each for nothing."""
    m, attempts = _watched(kernel, s), 1
    while (m.others_cpu > BUSY_WARN and attempts < 3 and not run.steady_busy
           and time.perf_counter() < deadline):
        time.sleep(1.0)
        m, attempts = min(m, _watched(kernel, s), key=lambda x: x.others_cpu), attempts + 1
        run.steady_busy = m.others_cpu > BUSY_WARN
    m.attempts = attempts
    return m


def _watched(run, s: Settings):
    """Run one measurement (after a short settle) and note how much of the machine other processes took meanwhile."""
    time.sleep(s.settle_s)
    watch = machine.OthersWatch()
    m = run()
    m.others_cpu = watch.share(s.threads)
    return m


def _machine_info(s: Settings) -> dict:
    return {
        "hostname": machine.hostname(), "cpu_model": machine.cpu_model(), "vendor": machine.cpu_vendor(),
        "cpus": s.threads, "memory_bytes": machine.memory_bytes(), "llc_bytes": machine.llc_bytes(),
        "versions": machine.versions(), "blas": machine.blas_info(),
    }


QUICK_S = 10  # about how long `kvwall calibrate --quick` takes once its kernels are built
FRESH_S = 24 * 3600  # a profile older than this (or from another host) is measured again before a report


def profile_age_s(path: Path) -> float | None:
    """Seconds since the profile at `path` was measured on this host; None when it is missing, unreadable,
    written by hand (no "measured" section) or from another machine."""
    try:
        measured = json.loads(Path(path).read_text())["measured"]
        when = datetime.datetime.fromisoformat(measured["date"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if measured.get("hostname") != machine.hostname():
        return None
    return (datetime.datetime.now(when.tzinfo) - when).total_seconds()


def stale_because(path: Path, max_age_s: float = FRESH_S) -> str | None:
    """Why the profile at `path` should be measured again, or None to use it as it is. A profile written by
    hand (no "measured" section) is kept; a damaged one too (loading it says so, and how to fix it)."""
    path = Path(path)
    if not path.is_file():
        return "there is none"
    try:
        measured = json.loads(path.read_text()).get("measured")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(measured, dict):
        return None
    if measured.get("hostname") != machine.hostname():
        return f"it was measured on another machine ({measured.get('hostname')})"
    age = profile_age_s(path)
    if age is None or not 0 <= age <= max_age_s:
        return "its date is unreadable" if age is None else f"it is {age / 3600:.0f} h old"
    return None


def fresh_profile(path: Path, max_age_s: float = FRESH_S, say: Callable[[str], None] | None = None) -> Path:
    """The profile at `path`, measured again (quick) first when it is missing, stale or from another host."""
    why = stale_because(path, max_age_s)
    if why:
        if say:  # calibrate builds the missing C++ kernels first: a first run's minutes are theirs
            from kvwall.engine.native import build_note

            builds = build_note()
            say(f"calibrating this machine first (`kvwall calibrate --quick`, about {QUICK_S:.0f} s): {why}"
                + (f"; {builds}" if builds else ""))
        save_profile(calibrate(quick=True).profile(), path)
    return path


def check_target(path: str | Path) -> Path:
    """Fail early (before minutes of measuring) if the profile could not be written to ``path``, or would replace
    a file that is not a profile (`--out notes.txt`). kvwall's own `local` profile may be replaced whatever it
    holds: a damaged one's error says to run `kvwall calibrate` again."""
    from kvwall.predict.devices import profile_path

    path = check_output(path, option="--out", make_parents=True, what="the profile")
    refuse_unless_ours(path, is_profile, "a kvwall device profile", own=profile_path)
    return path


def is_profile(data: object) -> bool:
    """Whether parsed JSON is a device profile: an object with the figures every profile has."""
    return isinstance(data, dict) and {"memory_bytes", "memory_bandwidth_Bps", "peak_flops"} <= data.keys()


def save_profile(profile: dict, path: Path) -> Path:
    """Write the profile as JSON atomically (kvwall.files: a unique temp file in the same folder, then rename),
    checking the target again: it may have changed during the minutes of measuring."""
    path = check_target(path)
    return write_text(path, json.dumps(profile, indent=2) + "\n")
