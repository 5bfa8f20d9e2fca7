"""One scheduler step as one forward over the paged pool: mixed prefill chunks and decode tokens, then sampling.

Each chunk of the step is one row of a right-padded (B, T) batch, T the longest chunk: row i holds
tokens [start, start + n) of its request at their true positions, padding is -1 (never written,
never attended). The pool's block tables come from the scheduler (ScheduledPages); attention reads
each row's blocks, so rows of any lengths share the forward. Rows whose chunk ends their sequence
give a logit at their last token and sample the next one with their own sampling settings and rules (penalties,
logit_bias, min_tokens: serve/logits.py). Log-probabilities come from the same forward: a forward holding a
prompt whose tokens' logprobs are asked for (echo) returns logits at every position, (B, T, V), instead of each
row's last, and those rows are scored there; a token's own logprob is read from the logits that sampled it.

A step runs its decode rows (B, 1) as one forward and its prefill chunks as one forward per length
(scheduler.forward_groups): rows of one forward are right-padded to the longest, so in one (B + B', T)
batch every decode row would carry T - 1 padding tokens through every matmul (32 decode rows beside a
512-token chunk: 16k wasted tokens), and a prompt's 88-token rest beside 128-token prompts 40; each
more forward costs one more read of the weights.

Memory: the pool is `kv_memory` bytes rounded down to whole blocks; one block is block_size tokens of
K and V in every attention layer, in the pool's format (fp32, bf16, fp16, or fp8: e4m3 clamped, no
scale, as the fp8 cache): the predictor's paged figure for one row of block_size tokens
(caches.registry.predicted_bytes). A smaller format holds more blocks, so more requests run at once.
"""

from __future__ import annotations

import time

import torch

from kvwall.engine.caches.base import KVCache, KVView, attention_specs, valid_tokens
from kvwall.engine.caches.fp8 import E4M3_MAX
from kvwall.engine.caches.paged import PagedCache
from kvwall.engine.caches.paged_kernel import attend_int_blocks, int_kernel
from kvwall.engine.caches.quant import dequantize, group_size, quantize
from kvwall.engine.caches.registry import predicted_bytes
from kvwall.engine.caches.state import has_state
from kvwall.engine.generate import Sampling, check_logits, greedy, pick
from kvwall.engine.threads import ThreadGovernor, step_on
from kvwall.errors import KvwallError
from kvwall.serve import logits as rules_
from kvwall.serve.scheduler import Chunk, Request, Scheduler, Step, forward_groups
from kvwall.spec.formats import get_format
from kvwall.units import fmt_bytes


class ScheduledPages(PagedCache):
    """The paged pool whose block tables the scheduler sets before each forward (``plan``), instead of
    growing them row by row; update() and the gather are PagedCache's."""

    def plan(self, tables: list[list[int]], lengths: list[int]) -> None:
        """Row i reads blocks tables[i], holding lengths[i] tokens once this step's tokens are written."""
        self._tables, self._lengths = tables, lengths

    def step(self, pos):
        self.set_table(self._tables, self._lengths, pos)

    def write(self, layer, k, v, pos):
        dtype = self.pools[layer][0].dtype  # a bf16 or fp8 pool under an fp32 model stores rounded K/V
        if dtype == torch.float8_e4m3fn:  # e4m3fn has no infinity: clamp, as the fp8 cache does
            k, v = k.clamp(-E4M3_MAX, E4M3_MAX), v.clamp(-E4M3_MAX, E4M3_MAX)
        return super().write(layer, k.to(dtype), v.to(dtype), pos)

    def copy_block(self, src: int, dst: int) -> None:
        for k, v in filter(None, self.pools):
            k[dst], v[dst] = k[src], v[src]  # (Hkv, bs, D)

    def release(self, row: int) -> None:
        raise AssertionError("the scheduler frees blocks; rows are not released")


class QuantizedPages(ScheduledPages):
    """A paged pool of integer K/V: every token's head vector quantized on write, in groups of the format's
    group along head_dim with an fp16 scale (and zero point), as caches/quant.py lays them out. A decode step
    reads the codes in place (paged_kernel.attend_int_blocks: dequantized in registers), inside the fused decode
    step where the model has one (stack_views); a prefill chunk, or a step the kernel cannot take (no compiler,
    a softcap, sinks; in_place False), gathers and dequantizes. Each
    token is quantized alone, so a block needs no full-precision residual and is never
    re-quantized; the price is that keys are grouped per token, not per channel as KIVI does (worse at 2-4
    bits, about exact at 8). One block = block_size tokens of `--kv-format int8` (or int4) in every attention
    layer: predict.memory's figure for that format (a test holds it)."""

    in_place = True  # decode steps read the packed blocks in place (False: always the gather and dequantize)

    def __init__(self, spec, block_size: int, n_blocks: int, fmt, device="cpu"):
        self.block_size, self.device, self.fmt = block_size, device, fmt
        self.table = self.k_pos = self.lengths = None
        self.decoding = False
        self.pools = [None if a is None else (self._store(n_blocks, a.n_kv_heads, a.head_dim),
                                              self._store(n_blocks, a.n_kv_heads, a.v_head_dim))
                      for a in attention_specs(spec)]

    def _store(self, n: int, heads: int, dim: int) -> tuple[int, list[torch.Tensor]]:
        g = group_size(self.fmt, dim)
        shape = (n, heads, self.block_size)
        parts = [torch.zeros(*shape, dim * self.fmt.bits // 8, dtype=torch.uint8, device=self.device),
                 torch.zeros(*shape, dim // g, dtype=torch.float16, device=self.device)]  # packed, scale
        if self.fmt.zero_bytes:
            parts.append(torch.zeros(*shape, dim // g, dtype=torch.float16, device=self.device))  # zero point
        return g, parts

    def write(self, layer, k, v, pos) -> None:
        """Quantize the new tokens and scatter their codes, scales and zero points into their blocks."""
        if self.decoding:  # each row's one new token (set_table found its block and slot)
            block, slot = self._new  # (B,), (B,)
            rows = (k[:, :, 0], v[:, :, 0])  # (B, H, D) each
        else:
            b, t, p = valid_tokens(pos)
            block, slot = self.table[b, p // self.block_size], p % self.block_size  # (N,), (N,)
            rows = (k[b, :, t], v[b, :, t])  # (N, H, D) each
        for (g, parts), x in zip(self.pools[layer], rows):
            coded = quantize(x, self.fmt, g)  # packed (N, H, D * bits / 8), scale (N, H, G), zero
            for part, value in zip(parts, coded):
                part[block, :, slot] = value

    def update(self, layer, k, v, pos):
        self.write(layer, k, v, pos)
        out = [self._gather_dequantized(g, parts) for g, parts in self.pools[layer]]  # (B, H, S, D) each
        return out[0].to(k.dtype), out[1].to(v.dtype), self.k_pos

    def attend(self, layer, q, k, v, pos, scale, window, softcap, sink: int = 0):
        """A decode step reads the codes in place (paged_decode_int); anything else gathers (KVCache.attend)."""
        kernel = int_kernel(q, softcap, sink) if self.in_place and self.decoding else None
        if kernel is None:
            return KVCache.attend(self, layer, q, k, v, pos, scale, window, softcap, sink)  # update(): the gather
        self.write(layer, k, v, pos)
        (_, kparts), (_, vparts) = self.pools[layer]
        return attend_int_blocks(kernel, q, kparts, vparts, self.fmt.bits, self.table, self.lengths, window,
                                 scale)  # (B, Hq, 1, Dv)

    def stack_views(self) -> list[KVView]:
        """Each layer's codes, scales and zero points: the fused decode step quantizes each new token as write()
        does (kernels/pool_rows.h's quantize_token, the same arithmetic) and reads the codes in place as attend()
        does."""
        views = []
        for (_, kparts), (_, vparts) in self.pools:
            kz, vz = (parts[2] if len(parts) == 3 else None for parts in (kparts, vparts))
            views.append(KVView("int", kparts[0], vparts[0], ks=kparts[1], kz=kz, vs=vparts[1], vz=vz,
                                bits=self.fmt.bits))
        return views

    def _gather_dequantized(self, g: int, parts: list[torch.Tensor]) -> torch.Tensor:
        rows = [self._gather(part) for part in parts]  # each (B, H, S, .)
        zero = rows[2] if len(rows) == 3 else None
        return dequantize(rows[0], rows[1], zero, self.fmt, g)  # (B, H, S, D)

    def copy_block(self, src: int, dst: int) -> None:
        for pair in filter(None, self.pools):
            for _, parts in pair:
                for part in parts:
                    part[dst] = part[src]

    def block_bytes(self) -> int:
        return sum(part[0].nbytes for pair in filter(None, self.pools) for _, parts in pair for part in parts)

    def pool_bytes(self) -> int:
        return sum(part.nbytes for pair in filter(None, self.pools) for _, parts in pair for part in parts)


POOL_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def pool_kv(kv):
    """What a pool stores: a float dtype (given as a dtype or a name, "bf16"), or an integer Format ("int8",
    "int4:g32"); a one-line error for anything else."""
    if isinstance(kv, torch.dtype):
        return kv
    if kv in POOL_FORMATS:
        return POOL_FORMATS[kv]
    fmt = get_format(kv)
    if fmt.is_float() or fmt.fixed or fmt.group is None:
        raise KvwallError(f"the paged pool stores {', '.join(POOL_FORMATS)} or int8 / int4 (with :gN, :sym), "
                          f"not {kv!r}")
    return fmt


def block_bytes(spec, block_size: int, kv) -> int:
    """Bytes of one block (block_size tokens of K and V in every attention layer) in `kv` (see pool_kv)."""
    kv = pool_kv(kv)
    element = next(n for n, d in POOL_FORMATS.items() if d == kv) if isinstance(kv, torch.dtype) else kv.label
    return predicted_bytes("paged", spec, 1, block_size, element=element, block_size=block_size)


def make_pool(spec, block_size: int, n_blocks: int, kv, device) -> ScheduledPages:
    """The pool for `kv` (see pool_kv): float K/V as they are, integer K/V quantized per token."""
    kv = pool_kv(kv)
    if isinstance(kv, torch.dtype):
        return ScheduledPages(spec, 1, block_size, n_blocks, dtype=kv, device=device)
    return QuantizedPages(spec, block_size, n_blocks, kv, device)


class Runner:
    def __init__(self, model, kv_memory: int | None = None, n_blocks: int | None = None, block_size: int = 16,
                 chunk: int = 512, max_batch: int = 64, kv_dtype=None, adapt_threads: bool = False):
        if has_state(model.spec):
            raise KvwallError(f"{model.spec.name} has SSM layers; serving runs attention-only models for now")
        w = next(model.parameters())
        self.model, self.device, kv = model, w.device, kv_dtype or w.dtype
        self.block_bytes = block_bytes(model.spec, block_size, kv)
        n_blocks = n_blocks or self._blocks_in(kv_memory)
        self.cache = make_pool(model.spec, block_size, n_blocks, kv, self.device)
        assert self.cache.block_bytes() == self.block_bytes, "the pool's block is the predictor's"
        self.sched = Scheduler(n_blocks, block_size, chunk, max_batch)
        self.sampling: dict[Request, tuple[Sampling, torch.Generator | None, rules_.Rules]] = {}
        # log-probabilities asked for, from the forward that sampled the token (no second pass): each request's
        # prompt tokens' (a list filled as its chunks run; delivered once whole), and this step's new tokens'
        self.prompt_logprobs: dict[Request, list] = {}
        self.scored: dict[Request, list] = {}  # the prompt logprobs that became whole in the last step
        self._whole: list[Request] = []
        self.token_logprobs: dict[Request, tuple[float, list[tuple[int, float]]]] = {}
        self.generated = self.computed = self.steps = 0
        self.busy_s = 0.0
        self.adapt_threads = adapt_threads  # each forward on the count a ThreadGovernor picks (engine/threads.py)
        self.governor: ThreadGovernor | None = None  # made by the thread that steps (torch's count is per thread)

    def _blocks_in(self, kv_memory: int | None) -> int:
        if not kv_memory or kv_memory < self.block_bytes:
            raise KvwallError(f"a KV memory of {fmt_bytes(kv_memory or 0)} holds no block of "
                              f"{fmt_bytes(self.block_bytes)}; give more KV memory (e.g. --kv-memory 512MiB)")
        return kv_memory // self.block_bytes

    def check(self, r: Request, sampling: Sampling = Sampling(), fix: str = "shorten the prompt or max_tokens") -> None:
        """A one-line error for a request that cannot run (bad sampling, a token outside the vocabulary, past
        the context or the pool; `fix` says what the caller changes for the last two, naming its own fields);
        reads only, so another thread may call it while this one steps."""
        sampling.check()
        vocab = self.model.spec.vocab
        if any(not 0 <= t < vocab for t in r.prompt):
            raise KvwallError(f"a prompt token id is outside the vocabulary [0, {vocab})")
        self.model.spec.check_context(len(r.prompt) + r.max_tokens, fix)
        self.sched.check_fits(r, fix)

    def add(self, r: Request, sampling: Sampling = Sampling(), rules: rules_.Rules = rules_.NONE) -> None:
        """Queue a request (after check()); `rules`: its penalties, biases and the logprobs it wants back."""
        self.check(r, sampling)
        if any(not 0 <= t < self.model.spec.vocab for t, _ in rules.logit_bias):
            raise KvwallError(f"a logit_bias token id is outside the vocabulary [0, {self.model.spec.vocab})")
        r.score_prompt = rules.prompt_logprobs is not None
        self.sched.add(r)
        seed = sampling.seed
        gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        self.sampling[r] = (sampling, gen, rules)
        if r.score_prompt:
            self.prompt_logprobs[r] = [None] * len(r.prompt)  # the first token has none: nothing comes before it

    def warm_up(self) -> None:
        """One 2-token request through prefill and decode, then the counters back to zero: the C++ kernels a
        model uses build on first use (the packed-weight kernel took 14 s here), which would otherwise land on
        the first client's TTFT. Its blocks return to the pool; too short to seal a block for prefix caching."""
        try:
            self.add(Request("warm-up", [0, 0], 2))
        except KvwallError:  # a pool too small for it: the first request pays instead
            return
        while self.sched.has_work():
            self.step()
        self.generated = self.computed = self.steps = 0
        self.busy_s = 0.0
        if self.governor:  # the warm-up ran in this thread, not in the worker's that steps from now on
            self.governor.close()
            self.governor = None

    def abort(self, r: Request) -> None:
        self.sched.abort(r)
        self.sampling.pop(r, None)
        self.prompt_logprobs.pop(r, None)

    @torch.inference_mode()
    def step(self) -> tuple[Step, list[Request]]:
        """Schedule, run one forward, sample; returns the step and the requests that finished in it."""
        t0 = time.perf_counter()
        step = self.sched.schedule()
        if not step.chunks:
            return step, []
        for src, dst in step.copies:
            self.cache.copy_block(src, dst)
        sampled, failed = {}, {}
        self._whole, self.token_logprobs = [], {}
        for rows in forward_groups(step.chunks):
            with self._threads(rows):
                logits = self.forward(rows)  # (B, V)
            sampled.update(self.sample(rows, logits, failed))
        self._drop(step, failed)
        self.scored = {r: self.prompt_logprobs.pop(r) for r in self._whole if r in self.prompt_logprobs}
        done = self.sched.finish(step, sampled)
        for r in done:
            self.sampling.pop(r, None)
        self.steps += 1
        self.computed += sum(c.n for c in step.chunks)
        self.busy_s += time.perf_counter() - t0
        return step, done

    def _threads(self, rows: list[Chunk]):
        """The governor's step for a forward of these rows (its times compare within one shape: rows, longest chunk),
        or a plain block without --threads auto."""
        if self.adapt_threads and self.governor is None:
            self.governor = ThreadGovernor()
        return step_on(self.governor, key=(len(rows), max(c.n for c in rows)))

    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Chunks as right-padded rows -> logits (B, V) at each row's last token."""
        T = max(c.n for c in chunks)
        tokens = torch.zeros(len(chunks), T, dtype=torch.long)  # (B, T)
        pos = torch.full((len(chunks), T), -1, dtype=torch.long)  # (B, T), -1 on padding
        for i, c in enumerate(chunks):
            tokens[i, :c.n] = torch.tensor(c.request.tokens[c.start:c.start + c.n])
            pos[i, :c.n] = torch.arange(c.start, c.start + c.n)
        self.cache.plan([c.request.blocks for c in chunks], [c.start + c.n for c in chunks])
        scoring = [c.request in self.prompt_logprobs and c.start < len(c.request.prompt) for c in chunks]
        every = any(scoring)  # a prompt whose tokens' logprobs are asked for: logits at every position
        logits = self.model(tokens.to(self.device), pos.to(self.device), self.cache, last_only=not every)
        if every:  # (B, T, V): score the prompts, then each row's last real token as last_only gives it
            for i, c in enumerate(chunks):
                if scoring[i]:
                    self._score_prompt(c, logits[i, :c.n])  # (n, V)
            logits = logits[torch.arange(len(chunks)), torch.tensor([c.n - 1 for c in chunks])]  # (B, V)
        else:
            logits = logits[:, 0]  # (B, V)
        check_logits(logits, f"at serving step {self.steps + 1}")
        return logits

    def _score_prompt(self, c: Chunk, logits: torch.Tensor) -> None:
        """logits (n, V) at tokens [start, start + n) of c's request -> the logprobs of the prompt tokens they
        predict, tokens [start + 1, start + n + 1) (the last of those is generated, not scored, where c ends
        the prompt)."""
        r = c.request
        k = self.sampling[r][2].prompt_logprobs
        found = self.prompt_logprobs[r]
        logp = logits.float().log_softmax(-1)  # (n, V)
        for j in range(c.n):
            p = c.start + j + 1
            if p < len(r.prompt):
                found[p] = rules_.top(logp[j], r.prompt[p], k)
        if c.start + c.n >= len(r.prompt):
            self._whole.append(r)

    def sample(self, chunks: list[Chunk], logits: torch.Tensor, failed: dict | None = None) -> dict[Request, int]:
        """The next token of each row whose chunk ended its sequence, with that request's own sampling. A row whose
        sampling raises goes into `failed` (request -> message) instead: one request's settings must not fail the
        others of the step (temperature 1e-300 once cut every stream in flight)."""
        rows = [i for i, c in enumerate(chunks) if c.sample]
        tops = greedy(logits).tolist()  # (B,)
        out = {}
        for i in rows:
            r = chunks[i].request
            s, gen, rules = self.sampling[r]
            try:
                row = rules_.apply(rules, logits[i], r.prompt, r.out)[None] if rules.shapes else logits[i:i + 1]
                if s.greedy:
                    out[r] = int(greedy(row)[0]) if rules.shapes else tops[i]
                else:
                    out[r] = int(pick(row, s, gen)[0])
                if rules.logprobs is not None:  # the model's own distribution at this row (rules_: why)
                    self.token_logprobs[r] = rules_.top(logits[i].float().log_softmax(-1), out[r], rules.logprobs)
            except Exception as e:
                if failed is None:
                    raise
                failed[r] = f"sampling failed: {e}"
        self.generated += len(out)
        return out

    def _drop(self, step: Step, failed: dict[Request, str]) -> None:
        """The requests whose sampling failed leave the step (their chunks are not recorded) and are aborted (their
        blocks go back to the pool); step.failed tells the caller why."""
        if not failed:
            return
        step.chunks = [c for c in step.chunks if c.request not in failed]
        for r in failed:
            self.abort(r)
        step.failed = failed

    def run_all(self, limit: int = 100_000) -> None:
        """Step until no request is left (bounded: a stuck scheduler is a bug, not an endless loop)."""
        for _ in range(limit):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {limit} steps")
