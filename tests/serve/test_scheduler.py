"""The scheduler and block manager without torch: a fake pool records which (position, token) each slot holds,
and a fake model's next token is a function of the whole sequence it reads back through the block table. So a
request's tokens equal its solo run only if every step read exactly its own K/V (no block shared wrongly, none
lost or overwritten), whatever the arrivals, chunk sizes, preemptions and prefix sharing."""

from __future__ import annotations

import pytest

from kvwall.errors import KvwallError
from kvwall.serve.scheduler import Request, Scheduler, forward_groups

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import (  # noqa: E402
    given,
    settings,
    strategies as st,
)

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    """The fake model: depends on every token and its position."""
    return sum((i + 1) * (t + 3) for i, t in enumerate(tokens)) * 7 % VOCAB


def solo(prompt: list[int], max_tokens: int, stop=frozenset()) -> list[int]:
    out = []
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
        if out[-1] in stop:
            break
    return out


class FakePool:
    """slot (block, offset) -> (position, token) written there; a forward writes every chunk, then reads."""

    def __init__(self, sched: Scheduler):
        self.sched, self.slots = sched, {}
        self.bs = sched.pool.block_size

    def run(self, step) -> dict:
        for src, dst in step.copies:
            for o in range(self.bs):
                if (src, o) in self.slots:
                    self.slots[(dst, o)] = self.slots[(src, o)]
        for c in step.chunks:
            for p in range(c.start, c.start + c.n):
                b = c.request.blocks[p // self.bs]
                assert not self.sched.pool.sealed(b), "a sealed (shareable) block is written"
                self.slots[(b, p % self.bs)] = (p, c.request.tokens[p])
        return {c.request: self.read(c) for c in step.chunks if c.sample}

    def read(self, c) -> int:
        r, end = c.request, c.start + c.n
        seen = [self.slots.get((r.blocks[p // self.bs], p % self.bs)) for p in range(end)]
        assert seen == list(enumerate(r.tokens[:end])), "a request read K/V that is not its own"
        return next_token([t for _, t in seen])


def drive(sched: Scheduler, arrivals: list[tuple[int, Request]], limit: int = 5000) -> int:
    """Run until every request finished, checking conservation after each step; returns the steps taken."""
    pool, pending, step_no = FakePool(sched), sorted(arrivals, key=lambda a: a[0]), 0
    while pending or sched.has_work():
        while pending and pending[0][0] <= step_no:
            sched.add(pending.pop(0)[1])
        step = sched.schedule()
        sched.finish(step, pool.run(step))
        sched.check()
        step_no += 1
        assert step_no < limit, "the scheduler stopped making progress"
    assert sched.used_blocks() == 0, "blocks leaked after every request finished"
    return step_no


PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9]]
request_st = st.tuples(st.integers(0, 6), st.sampled_from(range(len(PREFIXES))),
                       st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7), st.integers(1, 8))


@settings(max_examples=150, deadline=None)
@given(reqs=st.lists(request_st, min_size=1, max_size=7), block_size=st.integers(1, 4), chunk=st.integers(1, 12),
       max_batch=st.integers(1, 5), spare=st.integers(0, 6), stop=st.sets(st.integers(0, VOCAB - 1), max_size=3))
def test_every_request_equals_its_solo_run(reqs, block_size, chunk, max_batch, spare, stop):
    made = [(at, Request(i, PREFIXES[p] + tail, n, frozenset(stop))) for i, (at, p, tail, n) in enumerate(reqs)]
    need = max(-(-(len(r.prompt) + r.max_tokens) // block_size) for _, r in made)
    sched = Scheduler(need + spare, block_size, chunk, max_batch)  # spare 0: the biggest request fills the pool
    drive(sched, made)
    for _, r in made:
        assert r.out == solo(r.prompt, r.max_tokens, r.stop)
        assert r.finish == ("stop" if r.out[-1] in stop else "length")


def test_prefix_blocks_are_shared_and_counted():
    """Block size 2; A computes [1..6] + its own tail; B arrives once A's prompt is sealed: the 3 full blocks of
    the common prefix are B's first 3 blocks, taken from the cache, and B computes only its tail."""
    s = Scheduler(20, block_size=2, chunk=64)
    a, b = Request("a", [1, 2, 3, 4, 5, 6, 10], 3), Request("b", [1, 2, 3, 4, 5, 6, 11, 12], 3)
    steps = drive(s, [(0, a), (1, b)])
    assert s.pool.hits == 3 and b.cached_tokens == 6
    assert a.out == solo(a.prompt, 3) and b.out == solo(b.prompt, 3)
    assert steps == 4  # a: prefill + 2 decodes; b: prefill of 2 tokens at step 1 + 2 decodes


def test_a_fully_cached_prompt_recomputes_its_last_token_in_a_copy():
    """B's prompt is exactly A's 4 tokens (2 full blocks): B takes both, and its last token is recomputed in a
    private copy of the second block (copy-on-write): the sealed block is never written."""
    s = Scheduler(10, block_size=2, chunk=64)
    a = Request("a", [5, 6, 7, 8], 2)
    drive(s, [(0, a)])
    b = Request("b", [5, 6, 7, 8], 2)
    s.add(b)
    step = s.schedule()
    (chunk,) = step.chunks
    assert (chunk.start, chunk.n) == (3, 1)
    cached = s.pool.cached_prefix([5, 6, 7, 8])
    assert step.copies == [(cached[1], b.blocks[1])] and b.blocks[0] == cached[0] and b.blocks[1] != cached[1]
    s.finish(step, {b: next_token(b.tokens)})
    s.check()


def test_the_newest_request_is_preempted_and_recomputed():
    """4 blocks of 2 tokens; A (2 + 5 tokens, 4 blocks at the end) and B (2 + 5) admitted together: when the
    pool runs dry B, the newer, is preempted (never A), and both still equal their solo runs."""
    s = Scheduler(4, block_size=2, chunk=64)
    a, b = Request("a", [1, 2], 5), Request("b", [3, 4], 5)
    drive(s, [(0, a), (0, b)])
    assert a.preemptions == 0 and b.preemptions >= 1 and s.preemptions == b.preemptions
    assert a.out == solo([1, 2], 5) and b.out == solo([3, 4], 5)


def test_abort_frees_blocks_at_once():
    s = Scheduler(8, block_size=2, chunk=64)
    a = Request("a", [1, 2, 3], 4)
    s.add(a)
    s.finish(step := s.schedule(), FakePool(s).run(step))
    assert s.used_blocks() == 2
    s.abort(a)
    assert s.used_blocks() == 0 and a.finish == "abort" and not s.has_work()
    s.check()


def test_a_request_larger_than_the_pool_is_refused():
    s = Scheduler(4, block_size=2)
    with pytest.raises(KvwallError, match="need 5 KV blocks; the pool has 4"):
        s.add(Request("x", [1] * 6, 4))
    with pytest.raises(KvwallError, match="max_tokens >= 1"):
        s.add(Request("y", [1], 0))


def test_admission_leaves_a_block_for_each_decoding_request():
    """4 blocks of 2. A ([1, 2], 5 new: 4 blocks at the end) decodes holding 2 blocks when B (3 tokens + 4 new)
    arrives: taking the 2 free blocks would leave A none to grow into at step 3, so B waits until A finishes
    instead of being admitted and preempted two steps later."""
    s = Scheduler(4, block_size=2, chunk=64)
    a, b = Request("a", [1, 2], 5), Request("b", [3, 4, 5], 4)
    drive(s, [(0, a), (1, b)])
    assert s.preemptions == 0 and a.out == solo([1, 2], 5) and b.out == solo([3, 4, 5], 4)


def test_forward_groups_put_decode_rows_together_and_each_chunk_length_apart():
    rows = [(40, 1), (0, 128), (9, 1), (128, 88), (0, 128), (3, 5)]
    assert forward_groups(rows, n=lambda r: r[1]) == [[(40, 1), (9, 1)], [(3, 5)], [(128, 88)],
                                                       [(0, 128), (0, 128)]]
    assert forward_groups([]) == []
