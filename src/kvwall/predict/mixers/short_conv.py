"""LFM2's short convolution: no per-token cache; a fixed state per sequence.

Per sequence and layer: the conv state, ``width x l_cache`` (the last l_cache inputs B * x of each channel;
transformers' cache keeps l_cache of them, not l_cache - 1), counted in the state format like Mamba's conv state.

A decode step reads and writes that state; in_proj (hidden -> 3 x width: B, C, x) and out_proj are weights.
Tensor parallel splits the channels tp ways (in_proj by columns, the depthwise conv per channel, out_proj by
rows): ``shard``, the one place this rule is written.
"""

from __future__ import annotations

from kvwall.predict.step import ACT_BYTES, SCAN, Op, Step, matmul, split
from kvwall.spec.formats import Format
from kvwall.spec.model import ShortConv


def shard(m: ShortConv, tp: int) -> int:
    """Conv channels on one GPU."""
    return split(m.width, tp, "short-convolution channels")


def token_bytes(m: ShortConv, kv: Format, tp: int = 1) -> int:
    return 0


def tokens_held(m: ShortConv, context: int) -> int:
    return 0


def fixed_bytes(m: ShortConv, state: Format, tp: int = 1) -> int:
    return state.bytes(shard(m, tp), m.l_cache)


def shard_params(m: ShortConv, hidden: int, tp: int) -> float:
    return m.params(hidden) / tp


def label(m: ShortConv) -> str:
    return "short_conv"


def ops(i: int, m: ShortConv, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T = spec.hidden, st.tokens
    w = shard(m, tp)
    # per channel: B * x (1), the l_cache-tap depthwise conv (2 per tap), C * that (1)
    conv = Op("short conv", i, flops=T * w * (2 * m.l_cache + 2),
              state_bytes=st.batch * fixed_bytes(m, fm.state, tp) * (2 if st.past else 1),
              act_bytes=T * 4 * w * ACT_BYTES,  # B, C, x in; y out
              weight_bytes=w * (m.l_cache + (1 if m.bias else 0)) * fm.weights.bytes_per_element(), kind=SCAN)
    return [matmul("in_proj", i, T, h, 3 * w, fm.weights), conv, matmul("out_proj", i, T, w, h, fm.weights)]
