"""Mamba (S6): a fixed conv state (d_inner x d_conv) and SSM state (d_inner x d_state) per sequence.

Nothing grows with the context. Tensor parallel splits the d_inner channels.
"""

from __future__ import annotations

from kvwall.predict.step import ACT_BYTES, SCAN, Op, Step, matmul, split
from kvwall.spec.formats import Format
from kvwall.spec.model import Mamba


def token_bytes(m: Mamba, kv: Format, tp: int = 1) -> int:
    return 0


def tokens_held(m: Mamba, context: int) -> int:
    return 0


def fixed_bytes(m: Mamba, state: Format, tp: int = 1) -> int:
    d = split(m.d_inner, tp, "Mamba d_inner")
    return state.bytes(d, m.d_conv) + state.bytes(d, m.d_state)


def shard_params(m: Mamba, hidden: int, tp: int) -> float:
    return m.params(hidden) / tp


def label(m: Mamba) -> str:
    return "mamba"


def ops(i: int, m: Mamba, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T = spec.hidden, st.tokens
    d = m.d_inner // tp
    state = fixed_bytes(m, fm.state, tp)
    # recurrence per (channel, state) element: dt*A, exp, dt*B*x, A_bar*h + B_bar*x (2), y += C*h (2): 7 FLOPs
    scan = Op("selective scan", i, flops=T * (7 * d * m.d_state + 2 * d * m.d_conv),
              state_bytes=st.batch * state * (2 if st.past else 1),
              act_bytes=T * (2 * d + 2 * m.d_state + d) * ACT_BYTES,
              weight_bytes=d * (m.d_state + m.d_conv + 2) * fm.weights.bytes_per_element(), kind=SCAN)
    return [matmul("in_proj", i, T, h, 2 * d, fm.weights),
            matmul("x_proj", i, T, d, m.dt_rank + 2 * m.d_state, fm.weights),
            matmul("dt_proj", i, T, m.dt_rank, d, fm.weights), scan,
            matmul("out_proj", i, T, d, h, fm.weights)]
