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
