"""Continuous (iteration-level) batching over a paged pool: which tokens of which requests run in each step.

Torch-free: plain Python over token and block counts, so the predictor can replay the same policy.

A request's tokens are its prompt followed by what it generated; `computed` of them have K/V in the
pool. Each step (``schedule``) gives out at most `chunk` tokens (the token budget) to at most
`max_batch` requests:

1. running requests, oldest first: each gets its pending tokens (a prefill chunk, or the one token
   a decoding request sampled last step) up to what is left of the budget. When the pool cannot
   hold them, the newest running request is preempted (its blocks freed, put back at the head of
   the queue to be recomputed later), until they fit or the request itself was the newest;
2. waiting requests, in arrival order, while budget, seats and blocks last (none when this step
   preempted), leaving one free block per decoding request (so a newcomer is not preempted at
   once when they grow): first the blocks of their prompt's prefix that the prefix cache holds,
   then a first chunk.

A chunk that reaches the end of a request's tokens yields a logit, and the caller samples the next
token; ``finish`` records it, seals the blocks that became full, and retires requests that hit a
stop token or their length at once (their blocks go back to the pool).

Every request makes progress: the oldest running request is never preempted for a newer one, and
``add`` refuses a request that could not fit the whole pool alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvwall.errors import KvwallError
from kvwall.serve.blocks import BlockManager


@dataclass(eq=False)
class Request:
    id: object
    prompt: list[int]
    max_tokens: int  # new tokens at most
    stop: frozenset[int] = frozenset()  # token ids that end it (kept in its output)
    out: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens whose K/V are in the pool
    blocks: list[int] = field(default_factory=list)  # block table: logical block i -> pool block
    hashes: list[int] = field(default_factory=list)  # hash of each sealed (full, computed) block, in order
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at the last admission
    finish: str | None = None  # "stop", "length" or "abort" once retired
    score_prompt: bool = False  # every prompt token is computed (its logprob is asked for): no prefix-cache hit
    after: Request | None = None  # a sibling of the same prompt (n > 1): admitted once its prompt is computed, so
    #                               it takes that prompt's sealed blocks from the prefix cache instead of recomputing

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out)

    @property
    def pending(self) -> int:
        return self.length - self.computed


class Chunk:
    """Tokens [start, start + n) of a request run in this step; `sample`: the step yields its next token (the chunk
    reaches the end of the request's tokens), fixed when the chunk is made (as a property it was computed 2.6 M
    times in a 10,000-request simulation; a frozen dataclass's __init__ cost 1.9 us a chunk, a third more)."""

    __slots__ = ("request", "start", "n", "sample")

    def __init__(self, request: Request, start: int, n: int):
        self.request, self.start, self.n = request, start, n
        self.sample = start + n == len(request.prompt) + len(request.out)

    def __repr__(self) -> str:
        return f"Chunk(request={self.request.id!r}, start={self.start}, n={self.n})"


@dataclass
class Step:
    chunks: list[Chunk]
    copies: list[tuple[int, int]]  # (source, destination) blocks to copy before the forward (copy-on-write)
    preempted: list[Request]
    sampled: dict[Request, int] = field(default_factory=dict)  # filled by finish(): each new token
    failed: dict[Request, str] = field(default_factory=dict)  # requests dropped from the step (their sampling failed)


def forward_groups(items: list, n=lambda c: c.n) -> list[list]:
    """How kvwall serve runs a step's chunks (or (past, new) rows with `n` their new tokens): the decode rows in
    one forward, the prefill chunks in one forward per length, shortest first. A forward right-pads its rows to
    the longest, so chunks of one length pad nothing: a prompt's 88-token rest beside 128-token prompts computed
    40 padding tokens, and a decode row beside a chunk a whole chunk's worth."""
    by_length: dict[int, list] = {}
    for item in items:
        by_length.setdefault(n(item), []).append(item)
    return [by_length[k] for k in sorted(by_length)]


class Scheduler:
    def __init__(self, n_blocks: int, block_size: int = 16, chunk: int = 512, max_batch: int = 64):
        if chunk < 1 or max_batch < 1:
            raise KvwallError(f"the token budget ({chunk}) and the batch ({max_batch}) must be at least 1")
        self.pool = BlockManager(n_blocks, block_size)
        self.chunk, self.max_batch = chunk, max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.preemptions = 0

    # -- requests in and out ----------------------------------------------------------------------

    def add(self, r: Request) -> None:
        """Queue a request; one that could not fit the whole pool alone is refused (it would never run)."""
        self.check_fits(r)
        self.waiting.append(r)

    def check_fits(self, r: Request, fix: str = "shorten the request or give the server more KV memory") -> None:
        """A one-line error for a request this scheduler could never run, ending in `fix`; changes nothing."""
        if not r.prompt or r.max_tokens < 1:
            raise KvwallError("a request needs at least one prompt token and max_tokens >= 1")
        need = self.pool.blocks_for(len(r.prompt) + r.max_tokens)
        if need > self.pool.n_blocks:
            raise KvwallError(f"{len(r.prompt)} prompt + {r.max_tokens} new tokens need {need} KV blocks; the pool "
                              f"has {self.pool.n_blocks}: {fix}")

    def abort(self, r: Request) -> None:
        """Drop a request wherever it is (a client that went away): its blocks go back to the pool now."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self._retire(r, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------------

    def schedule(self) -> Step:
        step = Step([], [], [])
        budget = self._schedule_running(step, self.chunk)
        if not step.preempted:
            self._admit(step, budget)
        return step

    def _schedule_running(self, step: Step, budget: int) -> int:
        chunks, bs = step.chunks, self.pool.block_size
        for r in list(self.running):
            computed = r.computed
            n = min(len(r.prompt) + len(r.out) - computed, budget)  # r.pending, inline: 1.3 M rows a simulation
            if n == 0 or r in step.preempted:  # budget spent, or r was preempted for an older one (a list
                break                            # of the few preempted: `in self.running` was O(batch) a row)
            if n == 1:  # most rows: a decode token into its own partly filled, private block needs no block
                i, used = divmod(computed, bs)
                if used and i < len(r.blocks) and not self.pool.sealed(r.blocks[i]):
                    chunks.append(Chunk(r, computed, 1))
                    budget -= 1
                    continue
            while self._needs(r, n) > self.pool.n_free():
                victim = self.running[-1]
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is r:
                    return budget
            step.copies += self._grow(r, n)
            step.chunks.append(Chunk(r, r.computed, n))
            budget -= n
        return budget

    def _admit(self, step: Step, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            r = self.waiting[0]
            lead = r.after
            if lead is not None and lead.finish is None and lead.computed < len(lead.prompt):
                return  # its sibling's prompt blocks seal at the end of the step that computes them
            hit = [] if r.score_prompt else self.pool.cached_prefix(r.tokens)
            start = min(len(hit) * self.pool.block_size, r.length - 1)  # all cached: recompute the last token
            n = min(r.length - start, budget)
            need = self.pool.revive_cost(hit) + self._needs_after(len(hit), start, n)
            if need + self._reserve() > self.pool.n_free():
                return
            self.waiting.popleft()
            self._attach(r, hit, start)
            step.copies += self._grow(r, n)
            step.chunks.append(Chunk(r, r.computed, n))
            self.running.append(r)
            budget -= n

    def _reserve(self) -> int:
        """Free blocks an admission must leave: one per running request that is decoding (it may need a new
        block within the next block_size steps), so that a newcomer is not preempted again at once. None
        while nothing runs: a request that fits the empty pool always gets in."""
        return sum(1 for r in self.running if r.computed >= len(r.prompt))

    def _attach(self, r: Request, hit: list[int], computed: int) -> None:
        """r takes the cached blocks of its prefix; `computed` of its tokens are then in the pool."""
        for bid in hit:
            self.pool.take(bid)
        r.blocks, r.computed, r.cached_tokens = list(hit), computed, computed
        r.hashes = [self.pool.blocks[bid].hash for bid in hit]
        self.pool.hits += len(hit)

    def _needs(self, r: Request, n: int) -> int:
        """Free blocks r needs to compute n more tokens."""
        return self._needs_after(len(r.blocks), r.computed, n, r.blocks)

    def _needs_after(self, held: int, computed: int, n: int, blocks: list[int] | None = None) -> int:
        """Free blocks to compute tokens [computed, computed + n) holding `held` blocks: the new ones, plus a
        copy of the block written first when it is sealed (the only held block a chunk can write into).
        At admission (blocks None) every held block is a cached, sealed one."""
        new = max(self.pool.blocks_for(computed + n) - held, 0)
        first = computed // self.pool.block_size
        if first < held:
            new += 1 if blocks is None or self.pool.sealed(blocks[first]) else 0
        return new

    def _grow(self, r: Request, n: int) -> list[tuple[int, int]]:
        """Give r the blocks for n more tokens: a private copy of a sealed block it writes into, then new ones."""
        copies = []
        first = r.computed // self.pool.block_size
        if first < len(r.blocks) and self.pool.sealed(r.blocks[first]):
            new = self.pool.copy_on_write(r.blocks[first])
            copies.append((r.blocks[first], new))
            r.blocks[first] = new
            del r.hashes[first:]  # the copy is rewritten: it is sealed again once computed
        while len(r.blocks) < self.pool.blocks_for(r.computed + n):
            r.blocks.append(self.pool.allocate())
        return copies

    def _preempt(self, r: Request) -> None:
        """Free r's blocks; it goes back to the head of the queue and is recomputed (prompt + output so far)."""
        self.running.remove(r)
        self._free(r)
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    def _free(self, r: Request) -> None:
        self.pool.release(r.blocks)
        r.blocks, r.hashes, r.computed = [], [], 0

    # -- after the forward ------------------------------------------------------------------------

    def finish(self, step: Step, sampled: dict[Request, int]) -> list[Request]:
        """Record a step: `sampled` maps each request -> its new token for the chunks that sample. Returns the
        requests that finished (retired: their blocks are free again)."""
        done, step.sampled, bs = [], sampled, self.pool.block_size
        for c in step.chunks:
            r = c.request
            r.computed = c.start + c.n
            if len(r.hashes) < r.computed // bs:  # a block filled up (a decode row: one step in block_size)
                self._seal(r)
            if c.sample:
                token = sampled[r]
                r.out.append(token)
                if token in r.stop or len(r.out) >= r.max_tokens:
                    self.running.remove(r)
                    self._retire(r, "stop" if token in r.stop else "length")
                    done.append(r)
        return done

    def _seal(self, r: Request) -> None:
        """Seal r's blocks that are now full and computed, so later requests can share them."""
        bs = self.pool.block_size
        while len(r.hashes) < r.computed // bs:
            i = len(r.hashes)
            prev = r.hashes[-1] if r.hashes else None
            r.hashes.append(self.pool.seal(r.blocks[i], prev, _tokens(r, i * bs, (i + 1) * bs)))

    def _retire(self, r: Request, why: str) -> None:
        self._free(r)
        r.finish = why

    # -- invariants and gauges --------------------------------------------------------------------

    def check(self) -> None:
        """Blocks conserved; waiting requests hold none; running ones hold the blocks their computed tokens need."""
        assert all(not r.blocks for r in self.waiting), "a waiting request holds blocks"
        for r in self.running:
            assert len(r.blocks) >= self.pool.blocks_for(r.computed), "a request lost blocks it computed into"
        self.pool.check([r.blocks for r in self.running])

    def used_blocks(self) -> int:
        return self.pool.n_blocks - self.pool.n_free()


def _tokens(r: Request, lo: int, hi: int) -> tuple[int, ...]:
    """r.tokens[lo:hi] without joining its prompt and output (a 2k-token copy for every block a decode row seals)."""
    p = len(r.prompt)
    if hi <= p:
        return tuple(r.prompt[lo:hi])
    if lo >= p:
        return tuple(r.out[lo - p:hi - p])
    return tuple(r.prompt[lo:] + r.out[:hi - p])
