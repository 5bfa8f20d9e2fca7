"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): MLA over the top-k cached latents a lightning indexer picks.

Per token and sequence the layer keeps MLA's latent (``kv_lora_rank + qk_rope_head_dim`` elements, in the KV cache
format, as latent.py counts it) plus the indexer's own key (``index_head_dim`` values, in ``m.index_keys``: by
default as DeepSeek's inference code stores it, FP8 e4m3 with one fp32 scale per 128 values, whatever ``--kv``
says, since its scoring kernel reads that layout; transformers 5.25 keeps it in the model's dtype instead).

A decode step at context L: the indexer projects its queries (wq_b from MLA's query latent, weights_proj) and the
new key (wk), scores all L cached indexer keys with every index head (2 x heads x dim FLOPs per key) and keeps the
``index_topk`` best; MLA then attends to only those min(L, index_topk) latents (absorbed or naive, latent.py's ops
with the held tokens capped). A prefill step scores every key too, and its latent reads are counted for the whole
prompt (each query picks its own top-k, so together they touch all of it).

Tensor parallel: MLA as latent.py shards it; the indexer is replicated, as DeepSeek's inference code builds it
(wq_b and wk are plain, not column-parallel, Linear layers): every GPU holds the whole indexer and every indexer
key, and scores every cached token with all index heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwall.predict.mixers import latent
from kvwall.predict.step import ACT_BYTES, CACHE, Op, Step, matmul
from kvwall.spec.formats import Format
from kvwall.spec.model import SparseLatentAttention


def indexer_key_bytes(m: SparseLatentAttention) -> int:
    """Bytes of one token's indexer key, per sequence, on every GPU."""
    return m.index_keys.vector_bytes(m.index_head_dim)


def token_bytes(m: SparseLatentAttention, kv: Format, tp: int = 1) -> int:
    return latent.token_bytes(m.mla, kv, tp) + indexer_key_bytes(m)


def tokens_held(m: SparseLatentAttention, context: int) -> int:
    return context  # every latent and indexer key stays: a later query may pick any of them


def fixed_bytes(m: SparseLatentAttention, state: Format, tp: int = 1) -> int:
    return 0


def shard_params(m: SparseLatentAttention, hidden: int, tp: int) -> float:
    return latent.shard_params(m.mla, hidden, tp) + m.indexer_params(hidden)  # the indexer on every GPU


def label(m: SparseLatentAttention) -> str:
    return "sparse latent"


@dataclass(frozen=True)
class _TopK(Step):
    """A step whose decode queries attend to at most `topk` held tokens (a prefill's reads stay the whole cache)."""

    topk: int = 0

    def pairs(self, window: int | None) -> int:
        return super().pairs(self.topk)

    def held(self, window: int | None) -> int:
        return super().held(self.topk if self.new == 1 else window)


def ops(i: int, m: SparseLatentAttention, spec, st: Step, fm, tp: int, absorbed: bool) -> list[Op]:
    h, T, B = spec.hidden, st.tokens, st.batch
    H, D = m.index_n_heads, m.index_head_dim
    kb = indexer_key_bytes(m)
    held, pairs = st.held(None), st.pairs(None)
    # each query: q . k for every held key and index head (2 x H x D), relu and the head weighting (2 x H)
    score = Op("indexer scores (all keys)", i, flops=2 * B * H * (D + 1) * pairs,
               cache_read=B * held * kb, cache_write=B * st.new * kb, act_bytes=T * (H * D + H) * ACT_BYTES,
               kind=CACHE, detail=f"top-{m.index_topk} of {held:,}")
    indexer = [matmul("indexer wq_b", i, T, m.mla.q_lora_rank, H * D, fm.weights),
               matmul("indexer wk", i, T, h, D, fm.weights),
               matmul("indexer weights_proj", i, T, h, H, fm.weights), score]
    sparse = _TopK(st.batch, st.past, st.new, topk=m.index_topk)
    return indexer + latent.ops(i, m.mla, spec, sparse, fm, tp, absorbed)


def matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    """MLA's matrices and the indexer's (weights_proj stays in the dtype)."""
    return latent.matrices(m.mla, hidden) + [
        ("linear", "self_attn.indexer.wq_b", m.index_n_heads * m.index_head_dim, m.mla.q_lora_rank, 1),
        ("linear", "self_attn.indexer.wk", m.index_head_dim, hidden, 1)]
