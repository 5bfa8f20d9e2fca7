"""Roofline time: each op takes max(FLOPs / peak, bytes / bandwidth); a step is the sum of its ops.

Assumptions, stated in every output (``mode``: this is the ideal roof; predict/expected.py builds the
expected one from the same fields):

* peak = the device's dense peak for the compute dtype x ``compute_eff``;
  bandwidth = its memory bandwidth x ``mem_eff`` (defaults 1.0: an ideal
  roofline, a lower bound on time; the ``local`` profile's bandwidth is
  already a measured, achievable figure);
* ops do not overlap each other (no fusion across ops), and each op overlaps
  its own compute with its own memory traffic;
* a calibrated device (``local``) may carry the bandwidth each kind of kernel reaches: ops that read
  the cache stream at its attention bandwidth, the rest at its matrix-vector bandwidth;
* a device may carry a fixed dispatch cost per layer per step (``layer_overhead_s``, by mixer kind
  where measured, plus ``step_overhead_s`` outside the layers: measured by ``kvwall calibrate`` for
  the ``local`` profile, 0 for catalog devices);
* tensor parallel adds one ring all-reduce per block: 2 (tp-1)/tp x bytes over
  the interconnect plus a fixed latency; pipeline parallel runs stages one
  after another for one batch (no micro-batch overlap) and adds one
  point-to-point transfer of the activations between stages; expert parallel
  times the busiest GPU's share of the batch and adds an all-to-all dispatch
  and combine per MoE layer (predict/mixers/moe.py), each with the fixed latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvwall.errors import KvwallError
from kvwall.predict.devices import Device
from kvwall.predict.memory import Formats, Parallel, pipeline_stages
from kvwall.predict.ops import mixed_ops, step_ops
from kvwall.predict.step import ACT_BYTES, CACHE, LINK, MATMUL, PREFILL_ATTENTION, Op, Step, fixed_key
from kvwall.spec.model import ModelSpec


@dataclass(frozen=True)
class Roof:
    device: Device
    dtype: str = "bf16"
    compute_eff: float = 1.0
    mem_eff: float = 1.0
    link_latency_s: float = 5e-6  # per collective; NCCL small-message latency is a few microseconds
    mode: str = "ideal"  # "ideal" (datasheet peaks) or "expected" (fitted fractions, predict/expected.py)
    request_overhead_s: float = 0.0  # fixed cost of a prefill (a request's TTFT) beyond its step
    # a tensor-parallel run's extra fixed TTFT (expected mode's request_tp_s x (tp - 1)), fitted on batch-1 TTFT
    # runs: charged to a prefill phase, not to a serving step (simulate), where nothing says it holds the GPUs
    tp_ttft_s: float = 0.0

    @property
    def prefill_overhead_s(self) -> float:
        """What a prefill phase (a TTFT) pays beyond its step: the fixed cost per request and the TP TTFT term."""
        return self.request_overhead_s + self.tp_ttft_s

    @property
    def peak(self) -> float:
        return self.device.flops(self.dtype) * self.compute_eff

    @property
    def bandwidth(self) -> float:
        return self.device.bandwidth * self.mem_eff

    @property
    def balance(self) -> float:
        return self.peak / self.bandwidth

    def op_bandwidth(self, op: Op) -> float:
        """The bandwidth an op streams at: the device's, or (a calibrated `local` profile) the bandwidth its
        kind of kernel was measured to reach: attention over the cache (per kernel where measured:
        "attention:int8", "latent" ...), a matmul's weights by its number of rows, or matrix-vector for the rest."""
        measured = self.device.op_bandwidth
        if op.cache_read:
            bw = measured.get(op.kernel) or measured.get("attention")
        elif self._by_rows(op):  # a packed matrix at its own kernel's rates where they were measured
            packed = self.device.packed_rows.get(op.kernel)
            bw = rows_bandwidth(packed or self.device.matmul_rows, op.rows)
        else:
            bw = measured.get("matmul")
        return (bw or self.device.bandwidth) * self.mem_eff

    def _by_rows(self, op: Op) -> bool:
        return op.kind == MATMUL and bool(op.rows) and bool(self.device.matmul_rows)

    def memory_time(self, op: Op, nbytes: float) -> float:
        """Seconds to stream `nbytes` of `op`'s traffic. A matmul rated by its row count (`local`): the rate
        is of its weight bytes, its activations stream at the matrix-vector rate (all of them at the
        4,096-row rate put 4k prefill's MLP 3.4x too slow)."""
        if not self._by_rows(op):
            return nbytes / self.op_bandwidth(op)
        w = min(op.weight_bytes, nbytes)
        rest = (self.device.op_bandwidth.get("matmul") or self.device.bandwidth) * self.mem_eff
        return w / self.op_bandwidth(op) + (nbytes - w) / rest

    def op_flop_rate(self, op: Op) -> float | None:
        """FLOP/s of an op's own arithmetic where its kernel was measured (`local`: attention, MLA's latent
        attention; prefill attention by its query tokens where measured at several), paid on top of its bytes;
        None: the op's compute overlaps its memory traffic (the roofline)."""
        rate = self.device.op_flops.get(op.kernel) if op.kernel else None
        if op.kernel == PREFILL_ATTENTION and op.rows and self.device.prefill_attention:
            rate = log_interpolated(self.device.prefill_attention, op.rows)
        return rate * self.compute_eff if rate else None

    def work_time(self, op: Op, flops: float, nbytes: float) -> float:
        """Seconds for `flops` and `nbytes` of work of `op`'s kind: max(compute, memory) on the roofline, or,
        for a kernel measured on this CPU, fixed + FLOPs / its rate + bytes / its bandwidth. The sum because a
        CPU core does the loads and the arithmetic in turn: decode attention here took 10.8 ms with 12 KV heads
        and 4.2 ms with 1 at 32k tokens (same FLOPs), and bytes / 28 GB/s + FLOPs / 28 GFLOP/s fits both and
        the 8k and 1k points within 10 % (benchmarks/bench_attention_groups.py), where a max() cannot."""
        fixed = self.device.op_fixed_s.get(fixed_key(op), 0.0)
        rate = self.op_flop_rate(op)
        memory = self.memory_time(op, nbytes)
        if rate:
            return fixed + flops / rate + memory
        return fixed + max(flops / self.peak, memory)

    def op_time(self, op: Op) -> float:
        t = self.work_time(op, op.flops, op.bytes)
        if op.link_bytes:
            link = self.device.interconnect_bw
            t += self.link_latency_s + (op.link_bytes / link if link else math.inf)
        return t

    def bound(self, op: Op) -> str:
        if op.link_bytes and not op.flops and not op.bytes:
            return "link"
        compute = op.flops / (self.op_flop_rate(op) or self.peak)
        return "compute" if compute >= self.memory_time(op, op.bytes) else "memory"

    def assumptions(self) -> dict:
        return {"mode": self.mode, "device": self.device.name, "compute_dtype": self.dtype, "peak_flops": self.peak,
                "bandwidth_Bps": self.bandwidth, "compute_eff": self.compute_eff, "mem_eff": self.mem_eff,
                "link_latency_s": self.link_latency_s, "machine_balance": self.balance,
                "op_bandwidth_Bps": {k: v * self.mem_eff for k, v in self.device.op_bandwidth.items()},
                "layer_overhead_s": self.device.layer_overhead_s, "request_overhead_s": self.request_overhead_s,
                "tp_ttft_s": self.tp_ttft_s,
                "op_flops": {k: v * self.compute_eff for k, v in self.device.op_flops.items()},
                "op_fixed_s": dict(self.device.op_fixed_s),
                "matmul_rows_Bps": {m: v * self.mem_eff for m, v in self.device.matmul_rows.items()},
                "counted": "weights, KV cache, SSM state, 16-bit activations; not norms, residuals, rotary, softmax",
                "overlap": "none across ops; compute/memory overlap within an op"}


def rows_bandwidth(table: dict[int, float], rows: float) -> float:
    """Weight bytes/s of a matmul of `rows` rows, from rates measured at some row counts: interpolated in
    log2(rows) between them; below the first, the first; past the last, the last one's FLOP rate (time grows
    with the rows: the matmul is compute-bound there)."""
    last = max(table)
    return table[last] * last / rows if rows >= last else log_interpolated(table, rows)


def log_interpolated(table: dict[int, float], x: float) -> float:
    """A rate measured at some sizes, at size `x`: interpolated in log2(x) between them, the nearest end's
    outside them."""
    ms = sorted(table)
    if x <= ms[0] or x >= ms[-1]:
        return table[ms[0] if x <= ms[0] else ms[-1]]
    hi = next(i for i, m in enumerate(ms) if m >= x)
    lo_m, hi_m = ms[hi - 1], ms[hi]
    w = (math.log2(x) - math.log2(lo_m)) / (math.log2(hi_m) - math.log2(lo_m))
    return table[lo_m] + w * (table[hi_m] - table[lo_m])


@dataclass
class PhaseResult:
    name: str
    step: Step
    ops: list[Op]
    time_s: float
    flops: float
    bytes: float
    compute_s: float  # sum of FLOPs / peak
    memory_s: float  # sum of bytes / bandwidth
    link_s: float = 0.0
    per_op: list[dict] = field(default_factory=list)
    overhead_s: float = 0.0  # fixed per-layer dispatch cost included in time_s

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def as_dict(self) -> dict:
        return {"phase": self.name, "batch": self.step.batch, "past_tokens": self.step.past,
                "new_tokens": self.step.new, "time_s": self.time_s, "flops": self.flops, "bytes": self.bytes,
                "intensity": self.intensity if self.bytes else None, "compute_s": self.compute_s,
                "memory_s": self.memory_s,
                "link_s": self.link_s, "overhead_s": self.overhead_s, "bound": self.bound, "ops": self.per_op}


def run_step(spec: ModelSpec, step: Step, fm: Formats, roof: Roof, par: Parallel | None = None,
             name: str = "step", mla_absorbed: bool | None = None) -> PhaseResult:
    """Time one step on the roofline; with pipeline parallel, stages run one after another."""
    par = par or Parallel()
    return time_ops(spec, step, step_ops(spec, step, fm, par.tp, mla_absorbed, par.ep), roof, par, name)


def run_mix(spec: ModelSpec, groups: list[Step], fm: Formats, roof: Roof, par: Parallel | None = None,
            name: str = "mixed step") -> PhaseResult:
    """Time one continuous-batching step: prefill chunks and decode tokens of different sequences in one
    forward (`mixed_ops`). Its `step` reports the sequences, their mean past and new tokens."""
    par = par or Parallel()
    ops = mixed_ops(spec, groups, fm, par.tp, par.ep)
    seqs, tokens = sum(g.batch for g in groups), sum(g.tokens for g in groups)
    past = sum(g.batch * g.past for g in groups) // seqs
    return time_ops(spec, Step(seqs, past, tokens / seqs), ops, roof, par, name)


def pipeline_sends(spec: ModelSpec, tokens: int, par: Parallel) -> list[Op]:
    """The activations a step's `tokens` send between pipeline stages: one op over the pp - 1 boundaries (none
    without pipeline parallel); checks pp against the layer count."""
    if par.pp == 1:
        return []
    pipeline_stages(spec.n_layers, par.pp)
    return [Op("pipeline send", None, link_bytes=(par.pp - 1) * tokens * spec.hidden * ACT_BYTES, kind=LINK)]


def time_ops(spec: ModelSpec, step: Step, ops: list[Op], roof: Roof, par: Parallel | None, name: str) -> PhaseResult:
    """The step's ops on the roofline, one after another, plus the device's fixed cost per step."""
    par = par or Parallel()
    ops.extend(pipeline_sends(spec, par.local(step.tokens), par))
    overhead = step_overhead(spec, roof.device, weights_kernel(ops), decode=step.new == 1)
    per_op, total = [], overhead
    for op in ops:
        t = roof.op_time(op)
        total += t
        per_op.append({**op.as_dict(), "time_s": t, "bound": roof.bound(op)})
    flops = sum(o.flops for o in ops)
    nbytes = sum(o.bytes for o in ops)
    link = sum(roof.op_time(o) for o in ops if o.link_bytes)
    memory_s = sum(roof.memory_time(o, o.bytes) for o in ops)
    _check_finite(name, per_op, total, roof)
    return PhaseResult(name, step, ops, total, flops, nbytes, flops / roof.peak, memory_s, link, per_op, overhead)


def _check_finite(phase: str, per_op: list[dict], total: float, roof: Roof) -> None:
    """The last guard before a time is printed: never nan, inf or negative. Name the first op at fault."""
    if math.isfinite(total) and total >= 0:
        return
    bad = next((op for op in per_op if not (math.isfinite(op["time_s"]) and op["time_s"] >= 0)), None)
    if bad is not None and bad.get("link_bytes") and not roof.device.interconnect_bw:
        raise KvwallError(f"{phase}: {bad['name']!r} sends data between GPUs but device {roof.device.name!r} has no "
                          "interconnect figure; use --tp 1 --pp 1 or a device with a link")
    what = f"op {bad['name']!r} takes {bad['time_s']}" if bad else f"the fixed overhead is {total}"
    raise KvwallError(f"{phase}: {what} s on {roof.device.name!r}, not a finite time >= 0; check the device's "
                      "figures and the options")


def step_overhead(spec: ModelSpec, device: Device, kernel: str = "", decode: bool = True) -> float:
    """The device's fixed dispatch cost of one step: per layer by its mixer kind (and the packed `kernel` its
    projections run, Device.layer_overhead), plus the rest. `decode`: every row adds one token, a step the
    engine runs in one fused call when it takes every layer (fused_stack)."""
    rest = device.step_overhead_s if device.step_overhead_s is not None else device.layer_overhead_s
    kinds = (layer.mixer.kind if layer.mixer is not None else None for layer in spec.layers)
    fused = decode and fused_stack(spec)
    return rest + sum(device.layer_overhead(k, kernel, fused) for k in kinds)


def fused_stack(spec: ModelSpec) -> bool:
    """Whether the engine's fused decode step (engine/decode_stack.py) takes this model: attention and a gated MLP
    in every layer. By kind only: the few such layers it leaves to the layer-by-layer path (a softcap, partial
    rotary, LayerNorm) are not told apart here."""
    return all(layer.mixer is not None and layer.mixer.kind == "attention" and layer.ffn is not None
               and layer.ffn.kind == "mlp" and layer.ffn.gated for layer in spec.layers)


def default_compute_dtype(fm: Formats) -> str:
    """The math's dtype when none is asked for: the weights' own for fp32 and fp16 (a model held in full or half
    precision computes in it; on `local` this CPU's bf16 GEMM measured 1.4 GFLOP/s against fp32's 128, so fp32
    weights timed in bf16 predicted 1.2 tokens/s where the engine served 77), else bf16 (what quantized weights
    dequantize to)."""
    return fm.weights.label if fm.weights.label in ("fp32", "fp16") else "bf16"


def weights_kernel(ops: list[Op]) -> str:
    """The kernel the layers' projections run ("matmul:int4" ...; "" for float weights: F.linear)."""
    return next((o.kernel for o in ops if o.kind == MATMUL and o.layer is not None and o.kernel), "")


def prefill(spec, prompt: int, batch: int, fm: Formats, roof: Roof, par: Parallel | None = None) -> PhaseResult:
    """The prompt's step, plus the roof's fixed cost per request (0 on the ideal roof)."""
    r = run_step(spec, Step(batch, 0, prompt), fm, roof, par, name="prefill")
    r.time_s += roof.prefill_overhead_s
    r.overhead_s += roof.prefill_overhead_s
    return r


def decode(spec, context: int, batch: int, fm: Formats, roof: Roof, par: Parallel | None = None,
           mla_absorbed: bool | None = None) -> PhaseResult:
    """One decode step whose cache holds `context` tokens once this token is written."""
    return run_step(spec, Step(batch, context - 1, 1), fm, roof, par, name="decode", mla_absorbed=mla_absorbed)


def pipelined(spec: ModelSpec, step: Step, fm: Formats, roof: Roof, par: Parallel, micro_batches: int) -> dict:
    """Pipeline parallel with micro-batches: the batch split into m equal micro-batches that flow through the
    pp stages, each stage working on one at a time; a stage's time per micro-batch is its ops plus sending
    its activations on, and every micro-batch reads the stage's weights again.

    * one step alone (GPipe fill and drain): (m + pp - 1) x the slowest stage, plus the fixed step cost; the
      bubble, (pp - 1) / (m + pp - 1) of it, is time stages sit idle;
    * in steady state (a server keeps the pipeline full across decode steps): each micro-batch comes back
      every max(m, pp) stage times, so time per token = max(m, pp) x the slowest stage, tok/s = batch / that,
      and stages idle 1 - m / max(m, pp) of the time (none once m >= pp)."""
    m, pp = micro_batches, par.pp
    if m < 1 or step.batch % m:
        raise KvwallError(f"{m} micro-batches do not split a batch of {step.batch}; pick a divisor of the batch")
    micro = Step(step.batch // m, step.past, step.new)
    ops = step_ops(spec, micro, fm, par.tp, ep=par.ep)
    stage_of = {i: s for s, layers in enumerate(pipeline_stages(spec.n_layers, pp)) for i in layers}
    stages = [0.0] * pp
    for k, op in enumerate(ops):  # embedding (first op) on the first stage, the LM head (last) on the last
        stages[stage_of.get(op.layer, 0 if k == 0 else pp - 1)] += roof.op_time(op)
    send = roof.op_time(Op("pipeline send", None, link_bytes=par.local(micro.tokens) * spec.hidden * ACT_BYTES,
                           kind=LINK))
    slowest = max(stages) + (send if pp > 1 else 0.0)
    fixed = step_overhead(spec, roof.device, weights_kernel(ops), decode=step.new == 1)
    total = (m + pp - 1) * slowest + fixed
    steady = max(m, pp) * slowest + fixed
    if not (math.isfinite(total) and total >= 0):
        raise KvwallError(f"pipelined step: {total} s is not a finite time; does {roof.device.name!r} have a link?")
    return {"micro_batches": m, "micro_batch": micro.batch, "stage_s": stages, "send_s": send, "time_s": total,
            "bubble": (pp - 1) / (m + pp - 1), "steady_tpot_s": steady, "steady_tok_s": step.batch / steady,
            "steady_idle": 1 - m / max(m, pp)}


def compute_bound_batch(spec, context: int, fm: Formats, roof: Roof, par: Parallel | None = None,
                        scope: str = "step", limit: int = 1 << 16) -> int | None:
    """Smallest decode batch at which FLOP time reaches memory time, or None if not by `limit`.

    scope "step": the whole step; "weights": only the ops that read weights (projections, MLP,
    experts, LM head), which turn compute-bound near the machine balance while attention over the
    cache, whose intensity does not grow with batch, may never do.
    """
    def compute_bound(b: int) -> bool:
        r = decode(spec, context, b, fm, roof, par)
        ops = r.ops if scope == "step" else [o for o in r.ops if o.kind != CACHE]
        return sum(o.flops for o in ops) / roof.peak >= sum(roof.memory_time(o, o.bytes) for o in ops)

    if not compute_bound(limit):
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if compute_bound(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# -- speculative decoding ---------------------------------------------------------

def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens per target pass with k drafted tokens, each accepted with probability a
    (independently): (1 - a^(k+1)) / (1 - a)  [Leviathan et al. 2023, eq. 1]."""
    if not 0 <= acceptance <= 1:
        raise ValueError("acceptance must be in [0, 1]")
    if acceptance == 1:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def speculative(target: ModelSpec, draft: ModelSpec, context: int, k_values: list[int], acceptance: float,
                fm_target: Formats, fm_draft: Formats, roof: Roof, batch: int = 1) -> list[dict]:
    """Speed-up over plain decoding: E[tokens] x t_target(1) / (k x t_draft(1) + t_target(k+1 tokens))."""
    base = decode(target, context, batch, fm_target, roof).time_s
    draft_step = decode(draft, context, batch, fm_draft, roof).time_s
    rows = []
    for k in k_values:
        verify = run_step(target, Step(batch, context - 1, k + 1), fm_target, roof, name="verify").time_s
        e = expected_tokens(acceptance, k)
        t_iter = k * draft_step + verify
        rows.append({"k": k, "expected_tokens": e, "iteration_s": t_iter, "verify_s": verify,
                     "draft_s": k * draft_step, "time_per_token_s": t_iter / e, "speedup": e * base / t_iter})
    return rows


# -- energy (estimate) --------------------------------------------------------------

def energy_estimate(phase: PhaseResult, roof: Roof, energy_table: dict) -> dict:
    """Energy of a step: DRAM bytes x pJ/byte of the memory technology + FLOPs x (TDP / peak) pJ/FLOP.

    The per-FLOP figure is an upper bound (board power charged to math at full rate); the DRAM figure is
    the device-level access energy. Both are estimates with their sources in catalog/energy.json.
    """
    dev = roof.device
    dram = energy_table.get("dram", {}).get(dev.memory_tech or "", {})
    pj_byte = dram.get("pJ_per_byte")
    pj_flop = (dev.tdp_w / dev.flops(roof.dtype) * 1e12) if dev.tdp_w else None
    mem_j = phase.bytes * pj_byte * 1e-12 if pj_byte else None
    flop_j = phase.flops * pj_flop * 1e-12 if pj_flop else None
    board_j = dev.tdp_w * phase.time_s if dev.tdp_w else None
    parts = [x for x in (mem_j, flop_j) if x is not None]
    est = sum(parts) if parts else None
    if est is not None and board_j is not None:
        est = min(est, board_j)
    return {"estimate": True, "joules": est, "dram_joules": mem_j, "compute_joules_upper": flop_j,
            "board_power_bound_joules": board_j, "dram_pJ_per_byte": pj_byte, "memory_tech": dev.memory_tech,
            "pJ_per_flop_upper": pj_flop, "dram_source": dram.get("source"), "dram_confidence": dram.get("confidence")}
