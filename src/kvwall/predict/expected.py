"""Expected mode: the fractions of the datasheet peaks a real engine reaches, fitted to published measurements.

The ideal roofline (efficiency 1.0, no fixed costs) is a bound. The expected roof keeps the same ops and the
same max(FLOPs / peak, bytes / bandwidth) per op, and replaces the peaks by fitted, achievable figures
(``PARAMS``, stored in catalog/efficiency.json, or the user's own fit from ``kvwall validate --fit`` in
$KVWALL_HOME/efficiency.json: catalog.efficiency_file; predict/expected_fit.py fits them):

* weight streaming (projections, MLP, experts, LM head, embedding, SSM scans) at
  bandwidth x ``bw_weights`` x the device class's factor, x ``int_weights`` for integer weight formats
  (int8, int4: the dequantization costs), x ``int4_weights`` again for 4-bit ones;
* attention over the cache at bandwidth x ``bw_cache`` x the class factor, whatever the group (query heads per
  KV head). The form was chosen on leave-one-source-out (issue #43): a factor group ^ -e, fitted to the short
  rows alone, had e = 0.87 (Llama-3.1-8B's attention at 0.25 of the bandwidth); with the >= 16k rows it falls to
  0.39, and fixing e at 0 scores best held out by source: median 15.8 % against 19.6 % with e fitted and 28.2 % at
  e = 1 (>= 16k rows: 10.1 % against 31.0 % and 39.8 %). The long rows, where the cache is up to half the bytes
  read (Qwen3-30B-A3B at 32k: 3.2 GB of cache beside 3.5 GB of active weights), now fit bw_cache;
* math at peak x ``compute`` (x ``fp8_compute`` when the math is fp8, x ``compute_amd`` on the amd class), and
  prefill attention (the causal kernel over a prompt's tokens) at that x ``attn_prefill``: chosen on
  leave-one-source-out with the Qwen docs' vLLM rows (prompts of 14k to 129k tokens on an A100, issue #43): without
  it those long prefills pulled ``compute`` from 0.69 to 0.46 and TensorRT-LLM's rows, held out, went from 29 % to
  51 %; with it (and the vLLM V0 step cost below) the table scores 11.3 % held out by source (>= 16k: 11.6 %)
  against 18.6 % (22.2 %). Fitted, prefill attention reaches 0.39 of the GEMMs' fraction;
* fixed costs: ``layer_s`` per layer per step, ``step_s`` per step, ``collective_s`` x (tp - 1) per
  all-reduce, ``request_s`` once per prefill (TTFT), and ``request_tp_s`` x (tp - 1) more on a tensor-parallel
  prefill: the table's TP TTFT rows took 7-13 ms more than their bytes and FLOPs at 128 and at 2,048 prompt
  tokens alike. Those are batch-1 runs of a benchmark harness, so that part is a TTFT (Roof.tp_ttft_s), not a
  cost a serving step pays (the simulator does not charge it). ``tp`` is the collective group, so with --ep the
  ep GPUs pay it too: an extrapolation, as the table has tensor-parallel rows only.
* an engine's host work per decode step and per sequence per step (``HOST_COSTS``): fitted only on the table rows whose
  engine pays it (their ``host_cost``), so that the device figures do not absorb it, and never charged to a
  kvwall prediction, which is of an engine without it. vLLM's V0 engine (its 2024 builds) scheduled, sampled and
  detokenized every sequence in Python each step: the OCI MI300X rows' step grows by ~0.44 ms per sequence from
  batch 1 to 256 (27.8, 31.0, 40.1, 54.1, 80.8, 138.7 ms at 1 ... 256, prefill included), where a fraction of
  the peak FLOPs would stay flat up to batch ~100; fitted into compute_amd instead, it had set the AMD compute
  fraction to 0.52 of the others'. TensorRT-LLM's batch 384-1024 rows show no such cost. A part per step
  (``vllm_v0_step_s``) beside the one per sequence: the Qwen docs' rows are all at batch 1, where the two are one,
  and with only a per-sequence term, held out by source, they set it for OCI's batch-256 rows (-77 %). Held out
  by source: the step cost alone 12.8 %, ``attn_prefill`` alone 14.7 %, both 11.3 %.

Device classes (a class, not a device, because the table has few rows per device): ``hbm`` (datacenter GPUs
with HBM), ``gddr`` (workstation and consumer GPUs: GDDR, and NVIDIA's LPDDR5x DGX Spark), ``amd`` (AMD
Instinct), ``unified`` (Apple SoCs and CPUs: LPDDR / DDR main memory). Where DGX Spark belongs was chosen on
leave-one-source-out (issue #43): as gddr the table scores 15.8 % held out by source, as unified 25.1 %, as hbm
23.7 %. At batch 1 llama.cpp streams 73-87 % of its 273 GB/s (file size x tok/s of the dense rows: 2.52 GB x
78.97, 8.10 GB x 29.30), near the RTX 4090's 70 % of its GDDR6X (7.16 GB x 98.13 over 1,008 GB/s), where the
M2 Ultra's Metal kernels reached 55 % in 2023 (7.16 GB x 62.05 over 800 GB/s). The ``local`` profile keeps its
calibrated figures: on it expected == calibrated.
"""

from __future__ import annotations

from dataclasses import replace

from kvwall import catalog
from kvwall.errors import KvwallError
from kvwall.predict.devices import Device
from kvwall.predict.memory import Formats
from kvwall.predict.roofline import Roof
from kvwall.predict.step import PREFILL_ATTENTION
from kvwall.spec.model import ModelSpec
from kvwall.spec.validate import real_problem

MODES = ("expected", "ideal")
CLASSES = ("hbm", "gddr", "amd", "unified")

# name -> (what it is, start value for the fit, ridge: pulled toward 1 (a log-space penalty) when few rows say
# anything about it). One place: the fit, the file and the docs read this table.
PARAMS = {
    "bw_weights": ("fraction of bandwidth reached streaming weights (hbm class)", 0.7, False),
    "class_gddr": ("bandwidth factor of the gddr class relative to hbm", 1.0, True),
    "class_amd": ("bandwidth factor of the amd class relative to hbm", 1.0, True),
    "class_unified": ("bandwidth factor of the unified class relative to hbm", 1.0, True),
    "bw_cache": ("fraction of bandwidth reached by attention over the cache, any group (hbm class)", 0.7, False),
    "compute": ("fraction of the 16-bit peak reached by the math", 0.5, False),
    "compute_amd": ("compute factor of the amd class relative to the others", 1.0, True),
    "fp8_compute": ("extra factor on the fraction of peak when the math is fp8", 1.0, True),
    "int_weights": ("bandwidth factor for integer (int8 / int4) weights: dequantization", 0.8, False),
    "int4_weights": ("extra bandwidth factor for 4-bit integer weights", 1.0, True),
    "layer_s": ("seconds per layer per step (dispatch, norms, rotary: the work not counted)", 20e-6, False),
    "step_s": ("seconds per step outside the layers (sampling, scheduling)", 100e-6, False),
    "collective_s": ("seconds per all-reduce per extra GPU, x (tp - 1)", 10e-6, False),
    "request_s": ("seconds per prefill (a request's TTFT) beyond its step", 2e-3, False),
    "request_tp_s": ("seconds per prefill per extra tensor-parallel GPU, x (tp - 1)", 1e-3, False),
    "vllm_v0_row_s": ("seconds per sequence per decode step of vLLM's V0 engine (host_cost vllm-v0 rows only)",
                      50e-6, False),
    "vllm_v0_step_s": ("seconds per decode step of vLLM's V0 engine beyond its per-sequence cost (host_cost "
                       "vllm-v0 rows only)", 1e-3, False),
    "attn_prefill": ("factor on the math fraction for prefill attention (the causal kernel over a prompt)", 1.0,
                     False),
}
# a measurement row's host_cost -> its PARAMS figures, as Device.runner_step's terms (per step, per row per step)
HOST_COSTS = {"vllm-v0": {"fixed_s": "vllm_v0_step_s", "per_row_s": "vllm_v0_row_s"}}


def device_class(device: Device) -> str:
    """hbm, gddr, amd or unified, from the catalog entry's vendor and memory technology."""
    tech = (device.memory_tech or "").lower()
    if device.vendor.lower() == "amd":
        return "amd"
    if tech.startswith("gddr") or (device.vendor.lower() == "nvidia" and tech.startswith("lpddr")):
        return "gddr"  # an NVIDIA GPU on LPDDR (DGX Spark): chosen on leave-one-source-out (module docstring)
    if tech.startswith(("lpddr", "ddr")) or device.vendor.lower() in ("apple", "generic"):
        return "unified"
    return "hbm"


def fitted() -> dict:
    """The stored parameters (catalog.efficiency_file: the user's fit, else the packaged one); a one-line error
    if the file is missing, stale or holds a figure that is not a finite number >= 0."""
    data = catalog.efficiency()
    params = data.get("params") if isinstance(data.get("params"), dict) else {}
    missing = [k for k in PARAMS if real_problem(params.get(k), above_zero=False)]
    if missing:
        raise KvwallError(f"{catalog.efficiency_file()} lacks {', '.join(missing)} (or they are not finite numbers "
                          ">= 0); run `kvwall validate --fit`")
    return params


def expected_roof(device: Device, dtype: str, fm: Formats, spec: ModelSpec, tp: int = 1,
                  params: dict | None = None, host: str | None = None) -> Roof:
    """The roof with achievable figures for this device, formats and model; `local` keeps its calibration.
    `host` (a measurement row's host_cost, HOST_COSTS): that engine's runner cost per sequence per step."""
    if device.name == "local":
        return Roof(device, dtype, mode="expected")
    p = params if params is not None else fitted()
    cls = device_class(device)
    scale = p[f"class_{cls}"] if cls != "hbm" else 1.0
    weights = device.bandwidth * p["bw_weights"] * scale
    if fm.weights.name.startswith("int"):
        weights *= p["int_weights"] * (p["int4_weights"] if fm.weights.bits <= 4 else 1.0)
    cache = device.bandwidth * p["bw_cache"] * scale
    # prefill attention's math at its own fraction (op_flops: its few bytes, the fresh K/V, are added, not overlapped)
    prefill_attention = {PREFILL_ATTENTION: device.flops(dtype) * p["attn_prefill"]}
    dev = replace(device, op_bandwidth={"matmul": weights, "attention": cache}, layer_overhead_s=p["layer_s"],
                  mixer_overhead_s={}, step_overhead_s=p["step_s"], op_flops=prefill_attention,
                  runner_step={term: p[name] for term, name in HOST_COSTS[host].items()} if host else {})
    compute = p["compute"] * (p["fp8_compute"] if dtype == "fp8" else 1.0) * (p["compute_amd"] if cls == "amd" else 1.0)
    return Roof(dev, dtype, compute_eff=min(compute, 1.0), link_latency_s=p["collective_s"] * max(tp - 1, 1),
                mode="expected", request_overhead_s=p["request_s"], tp_ttft_s=p["request_tp_s"] * (tp - 1))


def make_roof(mode: str, device: Device, dtype: str, fm: Formats, spec: ModelSpec, tp: int = 1) -> Roof:
    """The roof of a mode: the ideal one (datasheet peaks) or the expected one."""
    if mode == "ideal":
        return Roof(device, dtype)
    if mode == "expected":
        return expected_roof(device, dtype, fm, spec, tp)
    raise KvwallError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


def describe(roof: Roof) -> str:
    """One line naming the mode, for table captions and report text."""
    if roof.mode == "ideal":
        return f"ideal roofline (compute x{roof.compute_eff:g}, bandwidth x{roof.mem_eff:g}, no fixed costs)"
    if roof.device.name == "local":
        return "expected: this machine's calibrated profile (kvwall calibrate)"
    return (f"expected: fractions of peak fitted to published measurements ({device_class(roof.device)} class; "
            f"table {catalog.efficiency_source()}); --ideal for the bound")

