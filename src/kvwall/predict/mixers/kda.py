"""Kimi Delta Attention (Kimi Linear's KDA layers): no per-token cache; a fixed state per sequence.

Per sequence and layer: the short-convolution state, ``conv_dim x conv_kernel`` (conv_dim = 3 x n_heads x
head_dim: the q, k and v channels; transformers' cache keeps the last conv_kernel inputs, not conv_kernel - 1),
plus the recurrent state, ``n_heads x head_dim x head_dim`` (keys and values have the same head_dim).

Both are counted in the state format (``--state``; by default the compute dtype), as Gated DeltaNet's are.
transformers keeps the conv state in the model's dtype but the recurrent state in float32 (its chunked and
recurrent kernels run in fp32 and the cache keeps their fp32 result), so ``--state fp32`` gives that part's figure.

A decode step reads and writes the state (the same delta rule as Gated DeltaNet, gated_deltanet.delta_rule; the
decay is a vector over the key channels instead of a scalar per head, the same FLOP count). Tensor parallel
splits the heads tp ways and the q/k/v, conv and gate channels with them; the two low-rank legs into head_dim
(f_a_proj, g_a_proj) and the shared o_norm stay whole on every GPU, as vLLM's KimiDeltaAttention keeps them
(ReplicatedLinear): ``shard`` and ``shard_params``, the one place this rule is written.
"""

from __future__ import annotations

from kvwall.predict.mixers.gated_deltanet import delta_rule
from kvwall.predict.step import Op, Step, matmul, split
from kvwall.spec.formats import Format
from kvwall.spec.model import KimiDeltaAttention


def shard(m: KimiDeltaAttention, tp: int) -> tuple[int, int]:
    """(heads, conv channels) on one GPU."""
    heads = split(m.n_heads, tp, "KDA heads")
    return heads, 3 * heads * m.head_dim


def token_bytes(m: KimiDeltaAttention, kv: Format, tp: int = 1) -> int:
    return 0


def tokens_held(m: KimiDeltaAttention, context: int) -> int:
    return 0


def fixed_bytes(m: KimiDeltaAttention, state: Format, tp: int = 1) -> int:
    heads, conv_dim = shard(m, tp)
    return state.bytes(conv_dim, m.conv_kernel) + state.bytes(heads * m.head_dim, m.head_dim)


def _replicated(m: KimiDeltaAttention, hidden: int) -> int:
    """f_a_proj and g_a_proj (hidden -> head_dim each) and the o_norm weight: on every GPU."""
    return 2 * hidden * m.head_dim + m.head_dim


def shard_params(m: KimiDeltaAttention, hidden: int, tp: int) -> float:
    whole = _replicated(m, hidden)
    return (m.params(hidden) - whole) / tp + whole


def label(m: KimiDeltaAttention) -> str:
    return "kda"


def ops(i: int, m: KimiDeltaAttention, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T, d = spec.hidden, st.tokens, m.head_dim
    heads, conv_dim = shard(m, tp)
    w = heads * d  # this GPU's q, k or v channels
    small = conv_dim * m.conv_kernel + w + heads + d  # conv, dt_bias (per channel), A_log (per head), o_norm
    rule = delta_rule("kimi delta rule", i, st, heads, d, d, conv_dim, m.conv_kernel, fixed_bytes(m, fm.state, tp),
                      small, fm)
    return [matmul("q/k/v/b_proj", i, T, h, 3 * w + heads, fm.weights),
            matmul("f_a/g_a_proj (low rank)", i, T, h, 2 * d, fm.weights),
            matmul("f_b/g_b_proj", i, T, d, 2 * w, fm.weights), rule,
            matmul("o_proj", i, T, w, h, fm.weights)]


def matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    """Its nn.Linear layers (the conv, dt_bias, A_log and o_norm stay in the dtype)."""
    w, d = m.qkv_dim, m.head_dim
    return [("linear", f"self_attn.{p}", w, hidden, 1) for p in ("q_proj", "k_proj", "v_proj")] + [
        ("linear", "self_attn.b_proj", m.n_heads, hidden, 1),
        ("linear", "self_attn.forget_gate.f_a_proj", d, hidden, 1),
        ("linear", "self_attn.forget_gate.f_b_proj", w, d, 1),
        ("linear", "self_attn.g_a_proj", d, hidden, 1), ("linear", "self_attn.g_b_proj", w, d, 1),
        ("linear", "self_attn.o_proj", hidden, w, 1)]
