"""Gated DeltaNet (Qwen3-Next, Qwen3.5 linear_attention layers): no per-token cache; a fixed state per sequence.

Per sequence and layer: the short-convolution state, ``conv_dim x conv_kernel`` (conv_dim = 2 x key_dim +
value_dim: the q, k and v channels; transformers' cache keeps the last conv_kernel inputs, not conv_kernel - 1),
plus the recurrent state, ``n_v_heads x k_head_dim x v_head_dim``.

Both are counted in the state format (``--state``; by default the compute dtype), the rule kvwall follows for
Mamba's conv and SSM states. transformers keeps the conv state in the model's dtype but builds the recurrent
state from float32 q/k/v, so a bf16 transformers model holds its recurrent state in fp32: ``--state fp32`` gives
that part's figure (it doubles the conv state too).

A decode step reads and writes the state; the projections are weights. Tensor parallel splits the key heads and
the value heads tp ways (both must divide), and the conv channels with them (``shard``, the one place this rule
is written).
"""

from __future__ import annotations

from kvwall.predict.step import ACT_BYTES, SCAN, Op, Step, matmul, split
from kvwall.spec.formats import Format
from kvwall.spec.model import GatedDeltaNet


def shard(m: GatedDeltaNet, tp: int) -> tuple[int, int, int]:
    """(key heads, value heads, conv channels) on one GPU."""
    k_heads = split(m.n_k_heads, tp, "Gated DeltaNet key heads")
    v_heads = split(m.n_v_heads, tp, "Gated DeltaNet value heads")
    return k_heads, v_heads, 2 * k_heads * m.k_head_dim + v_heads * m.v_head_dim


def token_bytes(m: GatedDeltaNet, kv: Format, tp: int = 1) -> int:
    return 0


def tokens_held(m: GatedDeltaNet, context: int) -> int:
    return 0


def fixed_bytes(m: GatedDeltaNet, state: Format, tp: int = 1) -> int:
    _, v_heads, conv_dim = shard(m, tp)
    return state.bytes(conv_dim, m.conv_kernel) + state.bytes(v_heads * m.k_head_dim, m.v_head_dim)


def shard_params(m: GatedDeltaNet, hidden: int, tp: int) -> float:
    return m.params(hidden) / tp


def label(m: GatedDeltaNet) -> str:
    return "gated_deltanet"


def delta_rule(name: str, i: int, st: Step, heads: int, k_dim: int, v_dim: int, conv_dim: int, conv_kernel: int,
               state: int, weight_elems: int, fm) -> Op:
    """The recurrent step of a gated delta rule (Gated DeltaNet, KDA) on one GPU: `heads` states of k_dim x v_dim
    (`state` bytes per sequence, read and written), after a depthwise conv of conv_dim channels x conv_kernel
    taps; `weight_elems` small weights (the conv, per-head and per-channel gate parameters, the norm)."""
    value_dim = heads * v_dim
    # per head and (k, v) state element, recurrent form: decay S*g (1, a scalar per head in GDN, a vector over k in
    # KDA: the same count), S^T k (2), S += k (x) delta (2), S^T q (2): 7 FLOPs; plus the depthwise conv (2 per
    # channel and tap) and the norms and gates (~4 per value)
    return Op(name, i, flops=st.tokens * (7 * heads * k_dim * v_dim + 2 * conv_dim * conv_kernel + 4 * value_dim),
              state_bytes=st.batch * state * (2 if st.past else 1),
              act_bytes=st.tokens * (conv_dim + 2 * value_dim) * ACT_BYTES,
              weight_bytes=weight_elems * fm.weights.bytes_per_element(), kind=SCAN)


def ops(i: int, m: GatedDeltaNet, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T = spec.hidden, st.tokens
    k_heads, v_heads, conv_dim = shard(m, tp)
    value_dim = v_heads * m.v_head_dim
    rule = delta_rule("gated delta rule", i, st, v_heads, m.k_head_dim, m.v_head_dim, conv_dim, m.conv_kernel,
                      fixed_bytes(m, fm.state, tp), conv_dim * m.conv_kernel + 2 * v_heads + m.v_head_dim, fm)
    in_out = 2 * k_heads * m.k_head_dim + 2 * value_dim + 2 * v_heads  # q, k, v, z and the b, a gates
    return [matmul("in_proj", i, T, h, in_out, fm.weights), rule,
            matmul("out_proj", i, T, value_dim, h, fm.weights)]


def matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    """Qwen3-Next / Qwen3.5 linear_attn's nn.Linear layers (the conv, A_log and norm stay in the dtype)."""
    return [("linear", "linear_attn.in_proj_qkvz", 2 * m.key_dim + 2 * m.value_dim, hidden, 1),
            ("linear", "linear_attn.in_proj_ba", 2 * m.n_v_heads, hidden, 1),
            ("linear", "linear_attn.out_proj", hidden, m.value_dim, 1)]
