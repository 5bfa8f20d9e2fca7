"""What fits, against hand arithmetic."""

import pytest

from kvwall.predict.fit import fit, parse_reserve
from kvwall.spec.resolve import load_spec

LLAMA8_WEIGHTS = 2 * 8_030_261_248  # bf16
LLAMA8_TOKEN = 131_072


def test_longest_context_and_largest_batch_by_hand():
    spec = load_spec("llama-3-8b")
    mem = LLAMA8_WEIGHTS + 1000 * LLAMA8_TOKEN + 5  # room for exactly 1000 tokens (plus 5 bytes)
    assert fit(spec, mem, batch=1, reserve_bytes=0).max_context == 1000
    assert fit(spec, mem, batch=4, reserve_bytes=0).max_context == 250
    assert fit(spec, mem, context=100, reserve_bytes=0).max_batch == 10
    assert fit(spec, mem, context=1001, reserve_bytes=0).max_batch == 0


def test_default_reserve_is_ten_percent():
    spec = load_spec("llama-3-8b")
    mem = 80 * 10**9
    expected = (mem - mem // 10 - LLAMA8_WEIGHTS) // LLAMA8_TOKEN
    assert fit(spec, mem, batch=1).max_context == expected


def test_weights_that_do_not_fit():
    res = fit(load_spec("llama-3-70b"), 80 * 10**9, batch=1)
    assert not res.weights_fit


def test_ssm_context_unbounded():
    res = fit(load_spec("mamba-2.8b"), 80 * 10**9, batch=1)
    assert res.unbounded


def test_paging_can_only_lower_the_fit():
    spec = load_spec("llama-3-8b")
    mem = LLAMA8_WEIGHTS + 1000 * LLAMA8_TOKEN
    assert fit(spec, mem, batch=1, reserve_bytes=0, block_size=16).max_context == 992  # 62 whole blocks


@pytest.mark.parametrize("text, expected", [(None, 8), ("25%", 20), ("0", 0), ("10B", 10)])
def test_parse_reserve(text, expected):
    assert parse_reserve(text, 80) == expected


def test_placement_is_the_smallest_tp_that_holds_weights_and_cache():
    from kvwall.predict.fit import placement

    spec = load_spec("llama-3-70b")  # 70,553,706,496 parameters: 141.1 GB in bf16
    weights = 2 * spec.params()
    # 80 GB per GPU, 8 GB reserve: tp 2 holds ~70.6 GB of weights (+ replicated norms) and a 4k cache of
    # 320 KiB x 4096 / 2 = 640 MiB per GPU -> fits; one GPU cannot hold 141 GB
    p = placement(spec, 80 * 10**9, batch=1, context=4096)
    assert p.tp == 2 and p.fits and weights > 72e9
    # at 128k x batch 8 the cache is 320 KiB x 131072 x 8 = 320 GiB: tp 8 gives 40 GiB + 17.6 GB per GPU
    assert placement(spec, 80 * 10**9, batch=8, context=131072).tp == 8
    assert not placement(spec, 80 * 10**9, batch=64, context=131072).fits  # 2.5 TiB of cache
    assert placement(load_spec("llama-3-8b"), 80 * 10**9).tp == 1
