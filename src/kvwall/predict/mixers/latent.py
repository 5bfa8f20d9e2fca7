"""Multi-head latent attention (MLA, DeepSeek-V2/V3): one latent c_kv plus one shared rope key per token.

Per token and sequence: ``kv_lora_rank + qk_rope_head_dim`` elements, whatever the head count. The
latent is shared by every head, so tensor parallel cannot split it: every GPU holds the whole cache
and the shared down-projection (kv_a and its norm); the per-head projections split tp ways.

Decode has two forms: *naive* up-projects the cached latent to per-head K and V (for every held
token, every step) and attends as usual; *absorbed* folds W_UK into the query and W_UV into the
output so attention runs in latent space (far fewer FLOPs, the same bytes).
"""

from __future__ import annotations

from kvwall.predict.step import ACT_BYTES, CACHE, Op, Step, matmul, per_head
from kvwall.spec.formats import Format
from kvwall.spec.model import LatentAttention


def token_bytes(m: LatentAttention, kv: Format, tp: int = 1) -> int:
    return kv.vector_bytes(m.kv_lora_rank + m.qk_rope_head_dim)


def tokens_held(m: LatentAttention, context: int) -> int:
    return context


def fixed_bytes(m: LatentAttention, state: Format, tp: int = 1) -> int:
    return 0


def shard_params(m: LatentAttention, hidden: int, tp: int) -> float:
    shared = hidden * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # kv_a + its norm, on every GPU
    return (m.params(hidden) - shared) / tp + shared


def label(m: LatentAttention) -> str:
    return "latent"


def ops(i: int, m: LatentAttention, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T, B = spec.hidden, st.tokens, st.batch
    H = m.n_heads // tp
    out = []
    if m.q_lora_rank:
        out += [matmul("q_a_proj", i, T, h, m.q_lora_rank, fm.weights),
                matmul("q_b_proj", i, T, m.q_lora_rank, H * m.qk_head_dim, fm.weights)]
    else:
        out.append(matmul("q_proj", i, T, h, H * m.qk_head_dim, fm.weights))
    out.append(matmul("kv_a_proj", i, T, h, m.kv_lora_rank + m.qk_rope_head_dim, fm.weights))
    lat = m.kv_lora_rank + m.qk_rope_head_dim
    held, pairs = st.held(None), st.pairs(None)
    tb = fm.kv.vector_bytes(lat)
    cache = dict(cache_read=B * held * tb, cache_write=B * st.new * tb)
    up_width = H * (m.qk_nope_head_dim + m.v_head_dim)
    if absorbed:
        out.append(per_head("q_absorb (W_UK)", i, T, H, m.qk_nope_head_dim, m.kv_lora_rank, fm.weights))
        out.append(Op("latent attention", i, flops=2 * B * H * pairs * (lat + m.kv_lora_rank),
                      act_bytes=T * H * (lat + m.kv_lora_rank) * ACT_BYTES, kind=CACHE, kernel="latent", **cache))
        out.append(per_head("out_absorb (W_UV)", i, T, H, m.kv_lora_rank, m.v_head_dim, fm.weights))
    else:
        up = matmul("kv_b_proj (up-project cache)", i, B * held, m.kv_lora_rank, up_width, fm.weights)
        up.act_bytes = B * held * up_width * ACT_BYTES  # the latent itself is counted as cache read
        up.kind = CACHE  # its work grows with the cache, not with the batch of new tokens
        out.append(up)
        out.append(Op("attention", i, flops=2 * B * H * pairs * (m.qk_head_dim + m.v_head_dim),
                      act_bytes=(T * H * (m.qk_head_dim + m.v_head_dim)) * ACT_BYTES, kind=CACHE, **cache))
    out.append(matmul("o_proj", i, T, H * m.v_head_dim, h, fm.weights))
    return out


def matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    """(tensor kind, module name, out, in, how many): the matrices a checkpoint stores in its weight format."""
    h = m.n_heads
    q = ([("linear", "self_attn.q_a_proj", m.q_lora_rank, hidden, 1),
          ("linear", "self_attn.q_b_proj", h * m.qk_head_dim, m.q_lora_rank, 1)] if m.q_lora_rank
         else [("linear", "self_attn.q_proj", h * m.qk_head_dim, hidden, 1)])
    return q + [("linear", "self_attn.kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, hidden, 1),
                ("linear", "self_attn.kv_b_proj", h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, 1),
                ("linear", "self_attn.o_proj", hidden, h * m.v_head_dim, 1)]
