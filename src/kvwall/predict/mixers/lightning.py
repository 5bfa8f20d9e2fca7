"""Lightning attention (MiniMax-01's linear_attention layers): no per-token cache; a fixed state per sequence.

Per sequence and layer: one K^T V state per head, ``n_heads x head_dim x head_dim``, nothing else (no short
convolution). transformers' MiniMaxCache keeps it in the model's dtype (``linear_cache``, built from the layer's
own q/k/v), so the state format (``--state``, by default the compute dtype) is what it holds.

A decode step reads and writes that state: S = exp(-slope) S + k^T v, o = q S. Tensor parallel splits the heads
tp ways and qkv_proj, output_gate, the norm and out_proj with them (vLLM's MiniMaxText01LinearAttention: column-
and row-parallel projections, a tensor-parallel RMSNorm): ``shard``, the one place this rule is written.
"""

from __future__ import annotations

from kvwall.predict.step import ACT_BYTES, SCAN, Op, Step, matmul, split
from kvwall.spec.formats import Format
from kvwall.spec.model import LightningAttention


def shard(m: LightningAttention, tp: int) -> int:
    """Heads on one GPU."""
    return split(m.n_heads, tp, "lightning-attention heads")


def token_bytes(m: LightningAttention, kv: Format, tp: int = 1) -> int:
    return 0


def tokens_held(m: LightningAttention, context: int) -> int:
    return 0


def fixed_bytes(m: LightningAttention, state: Format, tp: int = 1) -> int:
    return state.bytes(shard(m, tp) * m.head_dim, m.head_dim)


def shard_params(m: LightningAttention, hidden: int, tp: int) -> float:
    return m.params(hidden) / tp


def label(m: LightningAttention) -> str:
    return "lightning"


def ops(i: int, m: LightningAttention, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T = spec.hidden, st.tokens
    w = shard(m, tp) * m.head_dim  # this GPU's channels
    # per state element, recurrent form: decay S * exp(-slope) (1), + k (x) v (2), q S (2): 5 FLOPs; plus the
    # silu on q, k, v, the norm and the output gate (~4 per channel)
    rec = Op("lightning recurrence", i, flops=T * (5 * w * m.head_dim + 4 * w),
             state_bytes=st.batch * fixed_bytes(m, fm.state, tp) * (2 if st.past else 1),
             act_bytes=T * 5 * w * ACT_BYTES,  # q, k, v and the gate in, the output out
             weight_bytes=w * fm.weights.bytes_per_element(), kind=SCAN)  # the norm's weight
    return [matmul("qkv_proj + output_gate", i, T, h, 4 * w, fm.weights), rec,
            matmul("out_proj", i, T, w, h, fm.weights)]


def matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    """MiniMax's lightning attention (its RMSNorm stays in the dtype)."""
    return [("linear", "self_attn.qkv_proj", 3 * m.width, hidden, 1),
            ("linear", "self_attn.output_gate", m.width, hidden, 1),
            ("linear", "self_attn.out_proj", hidden, m.width, 1)]
