"""Request streams and serving statistics: hand-computed cases, numpy as the percentile reference."""

import json
import random

import pytest

from kvwall.errors import KvwallError
from kvwall.workload import Lengths, Record, Request, load_dataset, parse_lengths, percentile, stream, summarize


def test_lengths_parse():
    assert parse_lengths("512") == Lengths("fixed", 512)
    assert parse_lengths("lognormal:mean=512,sd=0.5") == Lengths("lognormal", 512, 0.5)
    assert parse_lengths("uniform:min=64,max=512") == Lengths("uniform", 64, 512)
    for bad in ["0", "-3", "lognormal:mean=512", "uniform:max=5,min=1", "uniform:min=9,max=3", "normal:mean=1,sd=1",
                "lognormal:mean=0.5,sd=1", ""]:
        with pytest.raises(KvwallError, match="bad token length"):
            parse_lengths(bad)


def test_lognormal_has_the_mean_asked_for():
    rng = random.Random(0)
    draws = [Lengths("lognormal", 512, 0.5).draw(rng) for _ in range(20000)]
    assert abs(sum(draws) / len(draws) / 512 - 1) < 0.02


def test_poisson_arrivals():
    reqs = stream(20000, Lengths("fixed", 8), Lengths("fixed", 4), rate=4.0, seed=1)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.01  # mean gap 1 / rate
    assert all(g >= 0 for g in gaps) and reqs[0].prompt_tokens == 8 and reqs[0].output_tokens == 4
    assert all(r.arrival_s == 0 for r in stream(3, Lengths("fixed", 8), Lengths("fixed", 4)))
    with pytest.raises(KvwallError):
        stream(0, Lengths("fixed", 8), Lengths("fixed", 4))
    with pytest.raises(KvwallError):
        stream(5, Lengths("fixed", 8), Lengths("fixed", 4), rate=-1)


def test_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "x" * 40, "output_tokens": 5}) + "\n\n"
                    + json.dumps({"prompt_tokens": 7, "output_tokens": 2}) + "\n")
    reqs = load_dataset(path)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(10, 5), (7, 2)] and reqs[0].prompt == "x" * 40
    path.write_text('{"prompt_tokens": 7, "output_tokens": 2}\n{"prompt_tokens": 7}\n')
    with pytest.raises(KvwallError, match="line 2: output_tokens"):
        load_dataset(path)
    path.write_text("not json\n")
    with pytest.raises(KvwallError, match="line 1 is not JSON"):
        load_dataset(path)
    with pytest.raises(KvwallError, match="cannot read"):
        load_dataset(tmp_path / "missing.jsonl")
    path.write_text('{"prompt_tokens": 7, "output_tokens": 2, "arrival_s": 1.5}\n'
                    '{"prompt_tokens": 3, "output_tokens": 2, "arrival_s": 0.25}\n')
    assert [r.arrival_s for r in load_dataset(path, rate=100.0)] == [1.5, 0.25]  # a recorded trace, replayed
    path.write_text('{"prompt_tokens": 7, "output_tokens": 2, "arrival_s": 1.5}\n'
                    '{"prompt_tokens": 3, "output_tokens": 2}\n')
    with pytest.raises(KvwallError, match="some lines have arrival_s"):
        load_dataset(path)
    path.write_text('{"prompt_tokens": 7, "output_tokens": 2, "arrival_s": -1}\n')
    with pytest.raises(KvwallError, match="arrival_s must be"):
        load_dataset(path)


def test_summary_by_hand():
    a = Record(Request(0, 0.0, 8, 3), [1.0, 2.0, 3.0])  # TTFT 1, TPOT 1, e2e 3
    b = Record(Request(1, 1.0, 8, 2), [1.5, 2.0])  # TTFT 0.5, TPOT 0.5, e2e 1
    c = Record(Request(2, 1.0, 8, 2), error="disconnected")
    s = summarize([a, b, c], slo_ttft=0.6)
    assert s["completed"] == 2 and s["errors"] == 1 and s["duration_s"] == 3.0
    assert s["request_throughput"] == pytest.approx(2 / 3) and s["output_token_throughput"] == pytest.approx(5 / 3)
    assert s["goodput"] == pytest.approx(1 / 3)  # only b meets TTFT <= 0.6
    assert s["ttft_s"]["p50"] == pytest.approx(0.75) and s["tpot_s"]["mean"] == pytest.approx(0.75)
    assert s["itl_s"]["p50"] == pytest.approx(1.0)  # gaps 1, 1, 0.5
    assert summarize([c])["completed"] == 0


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    xs = [random.Random(3).random() for _ in range(1)] + [random.Random(k).random() for k in range(57)]
    for p in (0, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert percentile([], 50) is None


def test_shared_prefix_goes_before_each_prompt():
    from kvwall.workload import with_shared_prefix

    reqs = with_shared_prefix([Request(0, 0.0, 10, 4), Request(1, 0.5, 3, 2)], 32)
    assert [(r.prompt_tokens, r.shared_tokens, r.output_tokens) for r in reqs] == [(42, 32, 4), (35, 32, 2)]
    assert with_shared_prefix(reqs, 0) == reqs
    with pytest.raises(KvwallError, match="shared prefix"):
        with_shared_prefix(reqs, -1)


def test_loadtest_prompts_share_their_first_words():
    from kvwall.measure.loadtest import Load, prompts

    plain = prompts(Load("http://x", "m", 3, prompt_tokens=5))
    shared = prompts(Load("http://x", "m", 3, prompt_tokens=5, shared_prefix=4))
    words = [p.split() for p in shared]
    assert all(len(w) == 9 for w in words) and words[0][:4] == words[1][:4] == words[2][:4]
    assert len({" ".join(w[4:]) for w in words}) == 3  # each its own 5 words after the prefix
    assert [len(p.split()) for p in plain] == [5, 5, 5]


def test_loadtest_token_id_prompts_are_exactly_that_long():
    """--token-ids: each prompt is exactly prompt_tokens ids (after shared_prefix shared ones), all below the
    vocabulary given, the same for the same seed and another for another."""
    from kvwall.measure.loadtest import Load, prompts

    got = prompts(Load("http://x", "m", 3, prompt_tokens=7, shared_prefix=2, token_ids=50))
    assert [len(p) for p in got] == [9, 9, 9] and all(0 <= t < 50 for p in got for t in p)
    assert got[0][:2] == got[1][:2] == got[2][:2] and len({tuple(p[2:]) for p in got}) == 3
    assert got == prompts(Load("http://x", "m", 3, prompt_tokens=7, shared_prefix=2, token_ids=50))
    assert got != prompts(Load("http://x", "m", 3, prompt_tokens=7, shared_prefix=2, token_ids=50, seed=1))


def test_dataset_shared_tokens(tmp_path):
    from kvwall.workload import with_shared_prefix

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt_tokens": 40, "output_tokens": 2, "shared_tokens": 32}\n'
                    '{"prompt_tokens": 9, "output_tokens": 2}\n')
    reqs = load_dataset(path)
    assert [r.shared_tokens for r in reqs] == [32, 0]
    assert [(r.prompt_tokens, r.shared_tokens) for r in with_shared_prefix(reqs, 16)] == [(56, 48), (25, 16)]
    path.write_text('{"prompt_tokens": 4, "output_tokens": 2, "shared_tokens": 5}\n')
    with pytest.raises(KvwallError, match="line 1: shared_tokens must be"):
        load_dataset(path)
