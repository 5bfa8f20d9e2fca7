"""A request stream served on any accelerator, in simulated time: kvwall serve's scheduler, roofline step times.

Torch-free. The scheduling policy is `kvwall.serve.scheduler.Scheduler` itself (imported, not copied):
admission by free KV blocks, chunked prefill under a token budget, preemption by recompute. Each step
it schedules takes the roofline's time for that step's exact mix (`StepClock`, equal to
`predict.roofline.run_mix`): prefill chunks and decode tokens at their own contexts, each op the max of
its compute and memory time, plus tensor/pipeline-parallel links and the device's fixed step cost.
Every token a step samples is stamped with the step's end; `workload.summarize` turns the stamps
into TTFT / TPOT / ITL / end-to-end percentiles, throughput and goodput.

Assumptions, stated in every output (`ASSUMPTIONS`):
* the KV pool is what one GPU has left after its share of the weights and the reserve, in blocks of
  `block_size` tokens of every attention layer (windows not exploited, as a paged pool does);
  SSM state is preallocated for `max_batch` sequences;
* a step is one forward over all its rows (vLLM's way; `split_prefill=True` runs the decode rows in one
  forward and the prefill chunks in one per length, as kvwall serve does: serve.scheduler.forward_groups);
* prompts share only a declared common prefix (`--shared-prefix`: kvwall serve's prefix cache then skips its
  full blocks, while they stay in the pool); every request runs to its output length (no stop);
* with pipeline parallel, up to pp micro-batches are in flight (pp schedulers, vLLM's virtual engines, over
  one shared pool); a step's time splits over the stages: the layers evenly, the LM head on the last stage;
* with expert parallel, one scheduler over the ep GPUs' pools together (its batch and chunk limits ep times
  one GPU's), and each step's rows split evenly over the ep GPUs: the step takes the busiest one's time.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, replace

import numpy as np

from kvwall.errors import KvwallError
from kvwall.predict import mixers
from kvwall.predict.memory import Formats, Parallel, memory, pipeline_stages, state_bytes, token_bytes
from kvwall.predict.ops import PER_SEQUENCE, embedding, layer_ops, lm_head
from kvwall.predict.roofline import Roof, pipeline_sends, step_overhead
from kvwall.predict.step import Step, matmul_kernel
from kvwall.serve.scheduler import Request as Job, Scheduler, forward_groups
from kvwall.spec.model import ModelSpec
from kvwall.workload import Record, Request, summarize

ASSUMPTIONS = {
    "scheduler": "kvwall serve's: chunked prefill under a token budget, admission by free KV blocks, "
                 "preemption by recompute (newest first)",
    "step_time": "roofline of the step's exact mix (run_mix): per op max(compute, memory) (a calibrated `local` "
                 "profile: its measured rates), plus links and the device's fixed step cost (a `local` profile's "
                 "per-layer cost is the fused decode step's where every row adds one token to a model of attention "
                 "+ gated MLP layers, else the layer-by-layer one); expected mode's fixed cost per request "
                 "(request_s) on a request's first step, but not its tensor-parallel TTFT term (request_tp_s: "
                 "fitted on batch-1 TTFT runs, nothing says it holds the GPUs)",
    "kv_pool": "one GPU's memory - reserve - its share of the weights, in blocks over every attention layer",
    "runner_cost": "a calibrated `local` profile's serving cost per step beyond the forward (the runner's "
                   "scheduling, tables and sampling, and the server streaming tokens to its clients), fixed + per "
                   "row + its measured slowdown x the step's forwards; 0 elsewhere",
    "pool_cost": "a calibrated `local` profile's paged pool cost (scatter, gather of each row's blocks padded to "
                 "the longest row, mask) per attention layer per forward, fixed + per byte gathered; 0 elsewhere",
    "prefix_cache": "only a declared shared prefix is shared (kvwall serve's prefix cache over sealed blocks; "
                    "the expected roof's fixed cost per request is charged on a request's first chunk, wherever the "
                    "cache left it, and not again after a preemption); every request runs to its output length",
    "pipeline": "with pp stages, up to pp micro-batches in flight (pp schedulers over one shared pool, a new "
                "request to the one with the fewest unfinished); layers split evenly, the LM head on the last stage",
    "expert_parallel": "with ep GPUs, one scheduler over their pools together (batch and chunk limits x ep); each "
                       "step's rows split evenly over them, routing uniform (moe.py)",
}
MAX_STEPS = 50_000_000  # a stuck scheduler is a bug, not an endless loop


class StepClock:
    """The roofline time of a scheduler step, fast: the per-token part cached by (tokens, sequences); the
    per-sequence ops (attention over each cache, SSM scans) computed once per distinct mixer and (past, new)
    row, added up over the rows with numpy. Equals `run_mix` on the same rows (a test holds it); the roof's fixed
    cost per request (expected mode) is `request_time`, which the simulator adds once per request."""

    def __init__(self, spec: ModelSpec, fm: Formats, roof: Roof, par: Parallel | None = None, block_size: int = 16):
        self.spec, self.fm, self.roof, self.par = spec, fm, roof, par or Parallel()
        self.block_size = block_size
        # per attention layer kind: one token's K and V bytes in the pool, and how many such layers
        self._pooled = [(b, n) for layer, n in Counter(spec.layers).items()
                        if (b := token_bytes(layer, fm.kv, self.par.tp))]
        self._mixers = list(Counter(layer.mixer for layer in spec.layers if layer.mixer is not None).items())
        self._layers = list(Counter(spec.layers).items())
        self._token_part: dict[tuple[int, bool], float] = {}
        self._head: dict[int, float] = {}  # the LM head's time by sequences
        self._rows: dict[tuple[int, int, bool], np.ndarray] = {}  # prefill chunks: (past, new, absorbed)
        self._decode: dict[bool, tuple[np.ndarray, np.ndarray]] = {}  # decode rows by past: table, filled
        self._fixed: dict[tuple[bool, bool], tuple[list, list]] = {}  # (absorbed, prefill): layer counts, ops

    def time(self, rows: list[tuple[int, int]]) -> float:
        """Seconds for one forward over rows of (past, new) tokens over the paged pool: the roofline's mixed step
        (`roofline_time`) plus the pool's own cost (`pool_time`)."""
        return self.roofline_time(rows) + self.pool_time(rows)

    def pool_time(self, rows: list[tuple[int, int]]) -> float:
        """The paged pool's cost beyond a contiguous cache, where the device measured it (`kvwall calibrate`:
        Device.paged_pool; 0 otherwise): per attention layer, fixed + bytes gathered x s/byte. The runner gathers
        every row padded to the longest row's blocks (one block table per forward), so a 16-token row beside a
        1,000-token one gathers 1,008 tokens."""
        cost = self.roof.device.paged_pool
        if not cost or not rows:
            return 0.0
        width = max(-(-(p + n) // self.block_size) for p, n in rows) * self.block_size  # tokens per row
        gathered = self.par.local(len(rows)) * width
        return sum(n * (cost.get("fixed_s", 0.0) + gathered * b * cost.get("s_per_byte", 0.0))
                   for b, n in self._pooled)

    def request_time(self, first: int) -> float:
        """The roof's fixed cost per request (expected mode: request_s) for a step that starts `first` requests'
        prompts (the busiest expert-parallel GPU's share); not roof.tp_ttft_s (Roof says why)."""
        return self.roof.request_overhead_s * self.par.local(first) if first else 0.0

    def runner_time(self, rows: list[tuple[int, int]], forward_s: float = 0.0) -> float:
        """What kvwall serve adds to a step beyond its forwards (the runner's scheduling and sampling, the server
        streaming the tokens, its threads slowing the forwards beside them), where the device measured it
        (Device.runner_time; 0 otherwise), once per step."""
        return self.roof.device.runner_time(len(rows), forward_s)

    def stages(self, total: float, rows: list[tuple[int, int]]) -> list[float]:
        """A step of `total` seconds over `rows` split over the pipeline's stages: the layers' share evenly (the
        stages' layer counts differ by one at most, pipeline_stages), the LM head on the last stage, each boundary's
        activation send on the stage before it. The parts add up to `total`, so a micro-batch alone takes as long
        as the whole step."""
        pp = self.par.pp
        if pp == 1:
            return [total]
        local = self.par.local
        send = sum(self.roof.op_time(o) for o in pipeline_sends(self.spec, local(sum(n for _, n in rows)), self.par))
        head = self.roof.op_time(lm_head(self.spec, local(len(rows)), self.fm, self.par.tp))
        body = (total - head - send) / pp
        return [body + send / (pp - 1)] * (pp - 1) + [body + head]

    def roofline_time(self, rows: list[tuple[int, int]]) -> float:
        """Seconds for one forward over rows of (past, new) tokens on the roofline: the token part plus the
        per-sequence ops, whose work adds up over the rows before each op's max(compute, memory). With expert
        parallel: the busiest GPU's share, 1/ep of the rows' tokens, sequences (rounded up) and work."""
        local, ep = self.par.local, self.par.ep
        pasts = [p for p, n in rows if n == 1]
        absorbed = len(pasts) == len(rows)
        chunks = [] if absorbed else [self._row(p, n, absorbed) for p, n in rows if n > 1]
        tokens = len(pasts) + (sum(n for _, n in rows if n > 1) if chunks else 0)
        total = self._per_token(local(tokens), local(len(rows)), absorbed)
        decode = self._decode_work(pasts, absorbed)  # (ops, 2): FLOPs, bytes
        decode = decode / ep if ep > 1 else decode
        if not chunks:
            return total + self._timed(decode, self._fixed[absorbed, False], True)
        chunk = sum(chunks) / ep
        if not pasts:
            return total + self._timed(chunk, self._fixed[absorbed, True], True)
        if self._same_kernels(absorbed):  # one op each, as run_mix merges them
            return total + self._timed(decode + chunk, self._fixed[absorbed, False], True)
        chunk_first = rows[0][1] > 1  # run_mix reads an op's weights with the first row's kernel
        return (total + self._timed(decode, self._fixed[absorbed, False], not chunk_first)
                + self._timed(chunk, self._fixed[absorbed, True], chunk_first))

    def _timed(self, work: np.ndarray, fixed: tuple[list, list], weights: bool) -> float:
        """The per-sequence ops' time for summed work (ops, 2), each op's weights read if `weights`."""
        layers, ops = fixed
        return sum(n * self.roof.work_time(op, float(f), op.weight_bytes * weights + float(b))
                   for n, op, (f, b) in zip(layers, ops, work))

    def _same_kernels(self, absorbed: bool) -> bool:
        """Whether decode rows and prefill chunks run every per-sequence op on the same calibrated kernel."""
        for prefill in (False, True):
            if (absorbed, prefill) not in self._fixed:
                self._row_work(0, 2 if prefill else 1, absorbed)
        decode, chunk = self._fixed[absorbed, False][1], self._fixed[absorbed, True][1]
        return [o.kernel for o in decode] == [o.kernel for o in chunk]

    def _per_token(self, tokens: int, seqs: int, absorbed: bool) -> float:
        """The per-token ops (projections, MLPs, experts, embedding, links) and the LM head, plus the device's
        fixed step cost: identical layers timed once and counted (time_ops on the whole list took 8 ms). `tokens`
        and `seqs` are one GPU's."""
        key = (tokens, absorbed, tokens == seqs)
        if key not in self._token_part:
            st, tp = Step(1, 0, tokens), self.par.tp
            kernel = matmul_kernel(self.fm.weights)  # packed weights pay the packed block's fixed cost (roofline's)
            t = step_overhead(self.spec, self.roof.device, kernel, decode=tokens == seqs)  # one token a row: fused
            t += self.roof.op_time(embedding(self.spec, tokens, self.fm))
            for layer, count in self._layers:
                ops = layer_ops(0, layer, self.spec, st, self.fm, tp, absorbed, self.par.ep)
                t += count * sum(self.roof.op_time(o) for o in ops if o.kind not in PER_SEQUENCE)
            t += sum(self.roof.op_time(o) for o in pipeline_sends(self.spec, tokens, self.par))
            self._token_part[key] = t
        if seqs not in self._head:
            self._head[seqs] = self.roof.op_time(lm_head(self.spec, seqs, self.fm, self.par.tp))
        return self._token_part[key] + self._head[seqs]

    def _decode_work(self, pasts: list[int], absorbed: bool) -> np.ndarray | float:
        """The decode rows' per-sequence work, summed: one numpy gather from a table filled per past on first use
        (a Python sum over 256 rows a step was a third of a simulation's time)."""
        if not pasts:
            return 0.0
        idx = np.fromiter(pasts, dtype=np.int64, count=len(pasts))
        table, filled = self._decode_table(int(idx.max()), absorbed)
        missing = idx[~filled[idx]]
        if missing.size:  # most steps: none, and no np.unique sort
            for p in np.unique(missing):
                table[p], filled[p] = self._row_work(int(p), 1, absorbed), True
        return table[idx].sum(axis=0)

    def _decode_table(self, top: int, absorbed: bool) -> tuple[np.ndarray, np.ndarray]:
        table, filled = self._decode.get(absorbed, (None, np.zeros(0, bool)))
        if top >= len(filled):  # grow by doubling, keeping what is filled
            size = max(2 * len(filled), top + 1, 1024)
            ops = len(self._row_work(0, 1, absorbed))
            grown, more = np.zeros((size, ops, 2)), np.zeros(size, bool)
            if table is not None:
                grown[:len(filled)], more[:len(filled)] = table, filled
            self._decode[absorbed] = table, filled = grown, more
        return table, filled

    def _row(self, past: int, new: int, absorbed: bool) -> np.ndarray:
        key = (past, new, absorbed)
        if key not in self._rows:
            self._rows[key] = self._row_work(past, new, absorbed)
        return self._rows[key]

    def _row_work(self, past: int, new: int, absorbed: bool) -> np.ndarray:
        """One row's per-sequence ops, one per distinct mixer: (FLOPs, bytes other than weights)."""
        ops, layers = [], []
        for m, count in self._mixers:
            mine = [o for o in mixers.of(m).ops(0, m, self.spec, Step(1, past, new), self.fm, self.par.tp, absorbed)
                    if o.kind in PER_SEQUENCE]
            ops += mine
            layers += [count] * len(mine)
        self._fixed.setdefault((absorbed, new > 1), (layers, ops))
        return np.array([(o.flops, o.bytes - o.weight_bytes) for o in ops], float).reshape(-1, 2)


@dataclass
class Pool:
    """The KV pool: bytes per block, and how many blocks fit (on one GPU; with expert parallel, on all ep)."""

    block_size: int
    block_bytes: int
    n_blocks: int
    available_bytes: int  # per GPU, after weights, reserve and SSM state

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def kv_pool(spec: ModelSpec, fm: Formats, par: Parallel, memory_bytes: int, reserve_bytes: int,
            block_size: int = 16, max_batch: int = 256, kv_memory: int | None = None) -> Pool:
    """Blocks of `block_size` tokens on the busiest GPU: `kv_memory` if given, else its memory less the
    reserve, its share of the weights and SSM state for `max_batch` sequences; with expert parallel, ep such
    GPUs' blocks."""
    stages = pipeline_stages(spec.n_layers, par.pp)
    per_token = max(sum(token_bytes(spec.layers[i], fm.kv, par.tp) for i in s) for s in stages)
    if per_token == 0:
        raise KvwallError(f"{spec.name} keeps no per-token cache; a paged pool does not apply")
    block = per_token * block_size
    given = kv_memory is not None
    if not given:
        rep = memory(spec, batch=1, context=1, formats=fm, parallel=par)
        weights = max(rep.stage_bytes(s)[0] for s in range(len(rep.stages)))
        kv_memory = memory_bytes - reserve_bytes - weights - max_batch * state_bytes(spec, fm.state) // par.tp
    if kv_memory < block:
        fix = ("give a larger --kv-memory" if given else
               "use more GPUs (--tp), a smaller --kv-format, or a smaller --reserve")
        raise KvwallError(f"no room for the KV cache: {max(kv_memory, 0):,} B {'given' if given else 'left'} per GPU, "
                          f"one block of {block_size} tokens takes {block:,} B; {fix}")
    return Pool(block_size, block, kv_memory // block * par.ep, kv_memory)


def simulate(requests: list[Request], clock: StepClock, pool: Pool, chunk: int = 512, max_batch: int = 256,
             split_prefill: bool = False, concurrency: int | None = None, on_step=None) -> dict:
    """Serve `requests` in simulated time: by their arrival times, or (`concurrency`) as that many clients that
    each send the next request when their last one finishes. Returns the records, the per-step trace
    (the step's end time; requests running and waiting, blocks in use and requests preempted as it ran), the
    preemption count, and with pipeline parallel the share of stage time spent idle (`pipeline_idle`).

    With pp pipeline stages the server keeps up to pp micro-batches in flight, as vLLM's virtual engines do:
    pp schedulers over one shared pool, each new request going to the one with the fewest unfinished; each
    sends its next micro-batch when its last one has left the last stage, and a stage works on one
    micro-batch at a time (`Pipeline`). Stages sit idle (the bubble) while fewer than pp schedulers have
    work. With pp = 1 it is one scheduler whose steps follow each other."""
    pipe, ep = Pipeline(clock.par.pp), clock.par.ep  # ep data-parallel GPUs: their limits add up
    engines = [Scheduler(pool.n_blocks, pool.block_size, chunk * ep, max_batch * ep) for _ in range(pipe.pp)]
    for e in engines[1:]:
        e.pool = engines[0].pool  # one pool: a free block goes to whichever micro-batch needs it
    clients = Clients(deque(sorted(requests, key=lambda r: r.arrival_s)), concurrency)
    records: dict[int, Record] = {}
    flight: list[tuple | None] = [None] * pipe.pp  # per engine: (end time, step, gauges as it ran)
    t, trace, finished = 0.0, [], 0
    for _ in range(MAX_STEPS):
        for r in clients.arrived(t):
            records[r.id] = Record(r)
            min(engines, key=lambda e: len(e.running) + len(e.waiting)).add(_job(r))
        freed = False  # an engine that could only preempt its own requests freed blocks for the others
        for v, e in enumerate(engines):  # every idle engine with work sends a micro-batch
            if flight[v] is None and e.has_work():
                step = e.schedule()
                freed |= bool(step.preempted)
                if step.chunks:
                    rows = [(c.start, c.n) for c in step.chunks]
                    first = sum(1 for c in step.chunks if _first(c))
                    gauges = (sum(len(x.running) for x in engines), sum(len(x.waiting) for x in engines),
                              engines[0].used_blocks(), len(step.preempted))
                    flight[v] = (pipe.send(t, clock, rows, split_prefill, first), step, gauges)
        ends = [(f[0], v) for v, f in enumerate(flight) if f]
        arrival = clients.next_arrival()
        if not ends:
            if freed:
                continue
            if arrival is None:
                if any(e.has_work() for e in engines):
                    raise AssertionError("the simulated server holds requests but can schedule none")
                break
            t = arrival
            continue
        end, v = min(ends)
        if arrival is not None and arrival < end and None in flight:  # an idle engine may take it first
            t = arrival
            continue
        t, (_, step, gauges), flight[v] = end, flight[v], None
        sampled = {c.request: 0 for c in step.chunks if c.sample}
        for job in sampled:
            records[job.id].token_times.append(t)
        done = engines[v].finish(step, sampled)
        clients.finished(len(done))
        finished += len(done)
        trace.append((t, *gauges))
        if on_step:
            on_step(t, finished)
    else:
        raise AssertionError(f"simulation still running after {MAX_STEPS} steps")
    out = {"records": list(records.values()), "trace": trace, "preemptions": sum(e.preemptions for e in engines),
           "prefix_cached_tokens": engines[0].pool.hits * pool.block_size}
    return out | ({"pipeline_idle": pipe.idle(t)} if pipe.pp > 1 else {})


class Pipeline:
    """The pipeline's stages in simulated time: a micro-batch goes through them in order, each stage taking one
    micro-batch at a time, in the order they were sent (nothing overtakes)."""

    def __init__(self, pp: int):
        self.pp = pp
        self.free_at = [0.0] * pp  # when each stage is next free
        self.busy = 0.0  # stage-seconds worked

    def send(self, t: float, clock: StepClock, rows: list[tuple[int, int]], split_prefill: bool,
             first: int = 0) -> float:
        """A micro-batch of `rows`, `first` of them requests' first chunks, sent at t: returns when it leaves the
        last stage (its tokens are sampled)."""
        total = _step_time(clock, rows, split_prefill) + clock.request_time(first)
        for k, dt in enumerate(clock.stages(total, rows)):  # [total] without a pipeline
            t = max(t, self.free_at[k]) + dt
            self.free_at[k] = t
        self.busy += total
        return t

    def idle(self, end: float) -> float:
        """Share of the stages' time up to `end` spent idle (0 when nothing ran)."""
        return 1 - self.busy / (self.pp * end) if end > 0 else 0.0


class Clients:
    """Where requests come from: an open stream (each at its arrival time), or `concurrency` closed-loop clients
    (the first ones at time 0, then one more each time one finishes, stamped with that time)."""

    def __init__(self, queue: deque, concurrency: int | None):
        self.queue, self.free = queue, concurrency  # free: clients with no request out (None: an open stream)

    def arrived(self, t: float) -> list[Request]:
        out = []
        while self.queue and (self.free is None and self.queue[0].arrival_s <= t or self.free):
            r = self.queue.popleft()
            if self.free is not None:
                self.free -= 1
                r = replace(r, arrival_s=t)
            out.append(r)
        return out

    def finished(self, n: int) -> None:
        if self.free is not None:
            self.free += n

    def next_arrival(self) -> float | None:
        """When the next request comes without anything finishing (None: never, for closed-loop clients)."""
        return self.queue[0].arrival_s if self.queue and self.free is None else None


def check_context(requests: list[Request], spec: ModelSpec) -> None:
    """kvwall serve refuses a request past the model's maximum context (prompt + output tokens): so does the
    simulation, before it starts, naming how many and the longest."""
    limit = spec.context_limit
    long = [r for r in requests if limit and r.prompt_tokens + r.output_tokens > limit]
    if long:
        r = max(long, key=lambda r: r.prompt_tokens + r.output_tokens)
        spec.check_context(r.prompt_tokens + r.output_tokens,
                           f"{len(long):,} of {len(requests):,} requests are that long ({r.prompt_tokens:,} prompt + "
                           f"{r.output_tokens:,} output tokens the longest), and kvwall serve would refuse them: "
                           "shorten --prompt-tokens, --output-tokens or --shared-prefix (or the dataset's)")


def _job(r: Request) -> Job:
    """The scheduler's request: its shared prefix's token ids (the same for every request: the prefix cache finds
    them), then ids of its own, the output length as max_tokens."""
    base = (r.id + 1) << 32
    own = r.prompt_tokens - r.shared_tokens
    return Job(r.id, list(range(r.shared_tokens)) + list(range(base, base + own)), r.output_tokens)


def _first(c) -> bool:
    """Whether a chunk is its request's first (from where the prefix cache left it, never after a preemption):
    where the expected roof's fixed cost per request is paid."""
    return c.start == c.request.cached_tokens and not c.request.preemptions


def _step_time(clock: StepClock, rows: list[tuple[int, int]], split_prefill: bool) -> float:
    """One scheduler step: its forward (with `split_prefill`, one per group as kvwall serve runs them:
    forward_groups), plus the runner's cost around them."""
    forward = sum(clock.time(p) for p in forward_groups(rows, n=lambda r: r[1])) if split_prefill else clock.time(rows)
    return forward + clock.runner_time(rows, forward)


def report(run: dict, slo_ttft: float | None = None, slo_tpot: float | None = None, points: int = 200) -> dict:
    """The summary (workload.summarize), preemptions, and the trace thinned to about `points` steps."""
    trace = run["trace"]
    every = max(1, math.ceil(len(trace) / points))
    keep = trace[::every] + ([trace[-1]] if trace and (len(trace) - 1) % every else [])
    return {**summarize(run["records"], slo_ttft, slo_tpot), "steps": len(trace), "preemptions": run["preemptions"],
            "prefix_cached_tokens": run.get("prefix_cached_tokens", 0),
            **({"pipeline_idle": run["pipeline_idle"]} if "pipeline_idle" in run else {}),
            "trace": [dict(zip(("time_s", "running", "waiting", "blocks_used", "preempted"), row)) for row in keep]}


def find_rate(run_at, slo_ttft: float | None, slo_tpot: float | None, lo: float, hi: float, tries: int = 12,
              quantile: int = 90) -> dict:
    """The largest Poisson rate in [lo, hi] whose p`quantile` TTFT and TPOT meet the SLO (bisection on a
    log scale). `run_at(rate)` returns a report; meeting is assumed to get harder as the rate grows. A rate
    whose requests all arrive within one median latency (requests / rate < p50 end to end) is a burst, never a
    steady rate, and does not count: 50 requests at 9,970/s met a 1 s TTFT in one batch while the run completed
    21 req/s (2026-12-04). `limited_by_requests`: such a burst met the SLO at a rate the search then refused."""
    burst_met = False

    def meets(rep: dict, rate: float) -> bool:
        nonlocal burst_met
        key = f"p{quantile}"
        ok_ttft = slo_ttft is None or (rep.get("ttft_s", {}).get(key) or math.inf) <= slo_ttft
        ok_tpot = slo_tpot is None or (rep.get("tpot_s", {}).get(key) or 0.0) <= slo_tpot
        ok = rep.get("completed", 0) > 0 and ok_ttft and ok_tpot
        steady = rep.get("requests", 0) / rate >= (rep.get("e2e_s") or {}).get("p50", 0.0)
        burst_met |= ok and not steady
        return ok and steady

    tried = []
    if not meets(low := run_at(lo), lo):
        return {"rate": None, "tried": [(lo, False)], "report": low, "limited_by_requests": burst_met}
    best, best_rep = lo, low
    for _ in range(tries):
        mid = math.sqrt(lo * hi)
        rep = run_at(mid)
        ok = meets(rep, mid)
        tried.append((mid, ok))
        if ok:
            lo, best, best_rep = mid, mid, rep
        else:
            hi = mid
    return {"rate": best, "tried": sorted(tried), "report": best_rep, "limited_by_requests": burst_met}
