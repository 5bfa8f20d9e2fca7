"""The decode thread governor (engine/threads.py): which count each step runs on, on a simulated machine whose step
times and run-queue delay the tests set, so every expected step number below is counted by hand from the rules:
a check every 8 steps once 4 steps are timed, a trial of 4 steps kept when its median is 10 % shorter, retries after
32 steps then doubling."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvwall.engine import threads  # noqa: E402
from kvwall.engine.threads import ThreadGovernor, run_queue_s  # noqa: E402


class Machine:
    """A step on n threads takes cost(n, crowded) seconds; while crowded our threads wait to run 0.6 s per second
    on 2 or more threads and not at all on 1 (the neighbour has the other core)."""

    def __init__(self, cost, crowded_until: int = 0):
        self.cost, self.crowded_until = cost, crowded_until
        self.now = self.delay = 0.0
        self.threads, self.step_no, self.sets = None, 0, []
        self.counts: list[int] = []  # the count each step ran on

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def run(self, gov: ThreadGovernor, steps: int, key=lambda i: None) -> None:
        for i in range(steps):
            with gov.step(key(i)):
                crowded = self.step_no < self.crowded_until
                s = self.cost(self.threads, crowded)
                self.now += s
                self.delay += 0.6 * s if crowded and self.threads > 1 else 0.0
                self.counts.append(self.threads)
                self.step_no += 1

    def governor(self, most: int = 2, waited=None) -> ThreadGovernor:
        return ThreadGovernor(most, clock=lambda: self.now, waited=waited or (lambda: self.delay),
                              set_threads=self.set_threads)


def two_cores(n: int, crowded: bool) -> float:
    """SmolLM2-like: quiet 10 ms on 2 threads, 18 ms on 1; beside a neighbour 30 ms on 2, 18 ms on 1."""
    return {(2, False): 0.010, (1, False): 0.018, (2, True): 0.030, (1, True): 0.018}[n, crowded]


def test_a_quiet_machine_keeps_every_thread_and_is_never_tried():
    m = Machine(two_cores)
    gov = m.governor()
    m.run(gov, 300)
    assert m.sets == [2] and gov.changes == [] and set(m.counts) == {2}


def test_beside_a_neighbour_it_drops_a_thread_and_retries_with_backoff():
    m = Machine(two_cores, crowded_until=10**9)
    gov = m.governor()
    m.run(gov, 200)
    # steps 1-8 on 2; step 8: crowded (0.6 s a second > 0.10) -> steps 9-12 on 1 (18 ms < 30 ms x 0.9): kept at 12
    assert gov.changes == [(12, 2, 1)]
    # retries of 2 threads: the first check at or after 12 + 32 = 44 is step 48 (steps 49-52), not kept, next after
    # 52 + 32 = 84: check 88 (89-92), next after 92 + 64 = 156: check 160 (161-164), next after 164 + 128
    on_two = [i + 1 for i, n in enumerate(m.counts) if n == 2]
    assert on_two == list(range(1, 9)) + [49, 50, 51, 52, 89, 90, 91, 92, 161, 162, 163, 164]


def test_the_threads_come_back_when_the_neighbour_leaves():
    m = Machine(two_cores, crowded_until=100)
    gov = m.governor()
    m.run(gov, 250)
    # as above until step 100; the retry at 161-164 finds 10 ms against 18 ms and keeps 2; quiet, no trial after
    assert gov.changes == [(12, 2, 1), (164, 1, 2)]
    assert set(m.counts[164:]) == {2} and m.sets[-1] == 2


def test_fewer_threads_that_are_slower_are_not_kept():
    m = Machine(lambda n, crowded: {4: 0.020, 3: 0.025}[n], crowded_until=10**9)
    gov = m.governor(most=4)
    m.run(gov, 200)
    # trials of 3 threads at 9-12, then after 12 + 32 = 44: check 48 (49-52), after 52 + 64 = 116: check 120
    # (121-124), after 124 + 128 = 252: none left
    assert gov.changes == []
    assert [i + 1 for i, n in enumerate(m.counts) if n == 3] == [9, 10, 11, 12, 49, 50, 51, 52, 121, 122, 123, 124]


def test_without_schedstat_nothing_changes():
    m = Machine(two_cores, crowded_until=10**9)
    m.run(m.governor(waited=lambda: None), 100)
    assert m.sets == [2] and set(m.counts) == {2}


def test_a_new_step_shape_drops_the_times_so_no_trial_compares_shapes():
    m = Machine(two_cores, crowded_until=10**9)
    gov = m.governor()
    m.run(gov, 100, key=lambda i: i // 3)  # a new shape every 3 steps: never 4 timed steps of one shape
    assert set(m.counts) == {2} and gov.changes == []


def test_close_gives_back_the_count_it_was_made_with():
    m = Machine(two_cores, crowded_until=10**9)
    gov = m.governor()
    m.run(gov, 20)
    assert m.threads == 1
    gov.close()
    assert m.threads == 2


def test_run_queue_seconds_sum_every_threads_second_schedstat_field(tmp_path):
    for tid, line in (("101", "7000 2000000000 5\n"), ("102", "9 500000000 2\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(line)
    assert run_queue_s(str(tmp_path)) == pytest.approx(2.5)
    assert run_queue_s(str(tmp_path / "absent")) is None


def test_run_queue_seconds_of_this_process():
    import os

    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc here")
    assert run_queue_s() >= 0.0


def test_generate_with_adapt_threads_matches_fixed_threads_and_restores_the_count(checkpoint, monkeypatch):
    from kvwall.engine.generate import generate
    from kvwall.engine.load import load_model

    model = load_model(checkpoint("llama")[0])
    prompt = [3, 14, 15, 92, 65, 35]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fixed = generate(model, [prompt], 24).tokens
        waits = iter(range(0, 10**6))  # a machine whose threads always wait: 1 s more at every read
        monkeypatch.setattr(threads, "run_queue_s", lambda: float(next(waits)))
        seen = []
        real = torch.set_num_threads
        monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
        auto = generate(model, [prompt], 24, adapt_threads=True)
        assert 1 in seen and auto.thread_trials[0][:3] == (12, 2, 1)  # a trial on 1 thread: steps 9-12 of the 23
        assert auto.tokens == fixed  # prompt + 24 tokens < 256: one attention piece a job on any count, the same sums
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
