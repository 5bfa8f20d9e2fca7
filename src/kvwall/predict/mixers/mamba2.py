"""Mamba-2 (SSD): a fixed conv state (conv_dim x d_conv) and multi-head SSM state (heads x head_dim x
d_state) per sequence, whatever the length.

Tensor parallel splits the heads; the B/C groups split too when there are at least tp of them,
else each GPU keeps one group (``shard``, the one place this rule is written).
"""

from __future__ import annotations

from kvwall.predict.step import ACT_BYTES, SCAN, Op, Step, matmul, split
from kvwall.spec.formats import Format
from kvwall.spec.model import Mamba2


def shard(m: Mamba2, tp: int) -> tuple[int, int, int]:
    """(heads, groups, conv_dim) on one GPU."""
    heads = split(m.n_heads, tp, "Mamba-2 heads")
    groups = m.n_groups // tp if m.n_groups >= tp else 1
    return heads, groups, heads * m.head_dim + 2 * groups * m.d_state


def token_bytes(m: Mamba2, kv: Format, tp: int = 1) -> int:
    return 0


def tokens_held(m: Mamba2, context: int) -> int:
    return 0


def fixed_bytes(m: Mamba2, state: Format, tp: int = 1) -> int:
    heads, _, conv_dim = shard(m, tp)
    return state.bytes(conv_dim, m.d_conv) + state.bytes(heads * m.head_dim, m.d_state)


def shard_params(m: Mamba2, hidden: int, tp: int) -> float:
    return m.params(hidden) / tp


def label(m: Mamba2) -> str:
    return "mamba2"


def ops(i: int, m: Mamba2, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T = spec.hidden, st.tokens
    H, groups, conv_dim = shard(m, tp)
    d = H * m.head_dim
    state = fixed_bytes(m, fm.state, tp)
    # per (head, head_dim, state) element: dt*x*B, decay*h + that (2), y += C*h (2): 5 FLOPs (recurrent form)
    ssd = Op("ssd scan", i, flops=T * (5 * d * m.d_state + 2 * conv_dim * m.d_conv + 4 * d),
             state_bytes=st.batch * state * (2 if st.past else 1), act_bytes=T * (conv_dim + 2 * d) * ACT_BYTES,
             weight_bytes=(conv_dim * (m.d_conv + 1) + 3 * H + (d if m.gated_norm else 0))
             * fm.weights.bytes_per_element(), kind=SCAN)  # conv + bias, dt_bias/A_log/D, the gated norm
    return [matmul("in_proj", i, T, h, 2 * d + 2 * groups * m.d_state + H, fm.weights), ssd,
            matmul("out_proj", i, T, d, h, fm.weights)]
