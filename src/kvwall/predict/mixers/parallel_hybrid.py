"""Falcon-H1's parallel layer: softmax attention and Mamba-2 side by side, on the same normed input.

Everything is its two parts' own, asked of their modules (attention.py, mamba2.py): the per-token K/V cache and
the tokens held are the attention part's, the fixed state is the Mamba-2 part's, a GPU's share of the parameters
and the ops of a step are both parts' (each split by its own tensor-parallel rule).
"""

from __future__ import annotations

from kvwall.predict.mixers import attention, mamba2
from kvwall.predict.step import Op, Step
from kvwall.spec.formats import Format
from kvwall.spec.model import ParallelHybrid


def token_bytes(m: ParallelHybrid, kv: Format, tp: int = 1) -> int:
    return attention.token_bytes(m.attention, kv, tp)


def tokens_held(m: ParallelHybrid, context: int) -> int:
    return attention.tokens_held(m.attention, context)


def kivi_bytes(m: ParallelHybrid, held: int, kv: Format, residual: int, residual_format: Format) -> int:
    """The attention part's K/V in a KIVI-style quantized cache (the engine's QuantizedCache holds it)."""
    return attention.kivi_bytes(m.attention, held, kv, residual, residual_format)


def fixed_bytes(m: ParallelHybrid, state: Format, tp: int = 1) -> int:
    return mamba2.fixed_bytes(m.mamba, state, tp)


def shard_params(m: ParallelHybrid, hidden: int, tp: int) -> float:
    return attention.shard_params(m.attention, hidden, tp) + mamba2.shard_params(m.mamba, hidden, tp)


def label(m: ParallelHybrid) -> str:
    return f"{attention.label(m.attention)}+mamba2"


def ops(i: int, m: ParallelHybrid, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    return (attention.ops(i, m.attention, spec, st, fm, tp, absorbed)
            + mamba2.ops(i, m.mamba, spec, st, fm, tp, absorbed))
