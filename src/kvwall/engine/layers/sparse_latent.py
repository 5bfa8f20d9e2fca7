"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): MLA (latent.py) over the top-k cached latents a lightning indexer
picks, as transformers 5.25's modeling_deepseek_v32.py runs it (its eager path, not the FP8 / FlashMLA kernels).

Symbols (the checkpoint's tensor names under self_attn.indexer.):
    c_q        = RMSNorm(W_DQ h), MLA's query latent (q_lora_rank)            q_a_proj, q_a_layernorm (latent.py's)
    q_j        = RoPE(W_IQ c_q)_j, the indexer query of index head j (D)      wq_b, rotary on the first d_r dims
    k_s        = RoPE(LayerNorm(W_IK h_s)), one indexer key per token (D)     wk, k_norm (weight and bias)
    w_j        = (W_W h)_j / sqrt(H_I), the weight of index head j            weights_proj
    I(t, s)    = sum_j w_j(t) relu(q_j(t) . k_s / sqrt(D))                    the index score of key s for query t
Each query t keeps the index_topk visible keys of largest I(t, s) and attends, as MLA, to those latents only.
The indexer rotates half-split (rope.rotate), MLA interleaved; both read one table of d_r angles.

The cache: the indexer key k_s sits beside MLA's rope key, so a layer holds per token the latent c (r) as the
KV contract's k and [k_pe (d_r) ; k_s (D)] as its v (kv_layout). Every cache that holds K/V by shape (contiguous,
sliding, paged, fp8) then keeps DSA's whole per-token state, k_s in the cache's K/V format (transformers keeps it
in the model's dtype; DeepSeek's inference code in fp8 + an fp32 scale per 128, which the predictor's
SparseLatentAttention.index_keys counts by default: caches/registry.py counts what the engine stores).

Paths (set_path, as MLA's): prefill and "naive" mask the unpicked keys out of the full attention (transformers'
way); a decode step on the "auto" / "absorbed" path runs the absorbed attention over the picked latents alone
(min(S, index_topk) of them), read where they lie by kernels/mla_decode.cpp's mla_decode_picked (torch: gathered
first), so it reads only the top-k latents, as DSA is meant to.
"""

from __future__ import annotations

import torch
from torch import nn

from kvwall.engine.layers.attention import visible
from kvwall.engine.layers.latent import LatentAttention
from kvwall.engine.layers.latent_kernel import mla_decode_picked
from kvwall.engine.layers.rope import rotate
from kvwall.spec.model import Attention as AttentionSpec, SparseLatentAttention as SparseSpec

INDEXER_NORM_EPS = 1e-6  # transformers 5.25: DeepseekV32Indexer.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)


class Indexer(nn.Module):
    """The lightning indexer: scores every cached token for each query and keeps the best index_topk."""

    def __init__(self, spec: SparseSpec, hidden: int):
        super().__init__()
        self.H, self.D, self.topk = spec.index_n_heads, spec.index_head_dim, spec.index_topk
        self.wq_b = nn.Linear(spec.mla.q_lora_rank, self.H * self.D, bias=False)
        self.wk = nn.Linear(hidden, self.D, bias=False)
        self.k_norm = nn.LayerNorm(self.D, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(hidden, self.H, bias=False)

    def project(self, x: torch.Tensor, q_lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' indexer queries (B, T, H_I, D) and keys (B, T, 1, D), before rotary."""
        B, T, _ = x.shape
        q = self.wq_b(q_lat).view(B, T, self.H, self.D)  # (B, T, H_I, D)
        return q, self.k_norm(self.wk(x))[:, :, None]  # (B, T, 1, D)

    def select(self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Slots each query keeps: x (B, T, hidden), rotated q (B, T, H_I, D), the cached keys (B, S, D), seen
        (B, T, S) the causal mask -> (B, T, min(S, index_topk)) slot indices. In fp32, in transformers' order."""
        scores = (q.float() @ keys.float().transpose(-1, -2)[:, None]) * self.D ** -0.5  # (B, T, H_I, S)
        # transformers keeps weights_proj in fp32 (_keep_in_fp32_modules) and feeds it fp32 activations
        w = nn.functional.linear(x.float(), self.weights_proj.weight.float()) * self.H ** -0.5  # (B, T, H_I)
        index = (w[:, :, None] @ scores.relu()).squeeze(-2)  # (B, T, S): sum_j w_j relu(q_j . k_s)
        index = index.masked_fill(~seen, float("-inf"))  # unseen slots last (padding, the future, empty)
        return top_slots(index, self.topk)  # (B, T, k)


def top_slots(index: torch.Tensor, k: int) -> torch.Tensor:
    """The min(k, S) slots of largest score in index (B, T, S); among equal scores at the cut the later slot (the
    later position, in every cache's slot order) wins. Ties are real: a key whose ReLU scores are 0 for every index
    head scores exactly 0 (2 of 9 keys of a query in a tiny model with 8 index heads), and torch.topk breaks them by
    an order that depends on S, so a padded batch (a longer S) would pick otherwise than its rows alone. torch.topk
    first (a stable sort instead took 11.4 ms against topk's 1.3 ms for top-2048 of 32k on this shared 2-core
    machine, same run); the tie rule only where a score equal to the k-th is left out."""
    k = min(k, index.shape[-1])
    cut = index.topk(k, dim=-1)  # (B, T, k) each
    kth = cut.values[..., -1:]  # (B, T, 1)
    if bool(((index >= kth).sum(-1) == k).all()):  # nothing equal to the k-th left out: topk's set is the only one
        return cut.indices
    tied, above = index == kth, index > kth  # (B, T, S) each
    need = k - above.sum(-1, keepdim=True)  # (B, T, 1): how many of the tied slots to take
    later = tied.flip(-1).cumsum(-1).flip(-1)  # (B, T, S): tied slots at or after each slot
    picked = above | (tied & (later <= need))  # (B, T, S): exactly k per query
    return picked.nonzero()[:, -1].view(*index.shape[:-1], k)  # (B, T, k), in slot order


class SparseLatentAttention(LatentAttention):
    @classmethod
    def build(cls, m: SparseSpec, spec, index: int) -> SparseLatentAttention:
        return cls(m, spec.hidden, index)

    @staticmethod
    def checkpoint_names(m: SparseSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        """MLA's tensors (latent.py) and the indexer's: wq_b, wk, k_norm (weight, bias), weights_proj."""
        out = LatentAttention.checkpoint_names(m.mla, hf, me, fused)
        names = ["wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"]
        return out | {f"{me}indexer.{n}": (f"{hf}indexer.{n}",) for n in names}

    @staticmethod
    def kv_layout(m: SparseSpec) -> AttentionSpec:
        """One "head": k the latent c_kv (r wide), v the rope key and the indexer key side by side (d_r + D)."""
        return AttentionSpec(m.mla.n_heads, 1, m.mla.kv_lora_rank, m.mla.qk_rope_head_dim + m.index_head_dim)

    @staticmethod
    def rotary(m: SparseSpec) -> tuple:
        return m.mla.rope, m.mla.qk_rope_head_dim

    def __init__(self, spec: SparseSpec, hidden: int, index: int):
        assert spec.mla.q_lora_rank, "DSA's indexer reads MLA's query latent (SparseLatentAttention.problems)"
        super().__init__(spec.mla, hidden, index)
        self.indexer = Indexer(spec, hidden)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: tuple | None, cache) -> torch.Tensor:
        B, T, _ = x.shape
        q_lat = self.q_norm(self.wq_a(x))  # (B, T, q_lora_rank): MLA's query latent, the indexer's input too
        q = self.wq_b(q_lat).view(B, T, self.H, self.dn + self.dr)  # (B, T, H, dn + dr)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)  # (B, T, H, dn), (B, T, H, dr)
        c, rope_key = self.wkv_a(x).split([self.r, self.dr], dim=-1)  # (B, T, r), (B, T, dr)
        c, rope_key = self.kv_norm(c), rope_key[:, :, None]  # (B, T, r), (B, T, 1, dr)
        iq, ik = self.indexer.project(x, q_lat)  # (B, T, H_I, D), (B, T, 1, D)
        if rope is not None:
            q_pe, rope_key = self.rotate(q_pe, rope), self.rotate(rope_key, rope)  # MLA: interleaved pairs
            iq, ik = rotate(iq, rope), rotate(ik, rope)  # the indexer: half-split, its first dr dims
        v = torch.cat([rope_key, ik], dim=-1).transpose(1, 2)  # (B, 1, T, dr + D): the kv_layout's v
        c_all, v_all, k_pos = cache.update(self.index, c[:, None], v, pos)  # (B, 1, S, r), (B, 1, S, dr + D)
        c_all, v_all = c_all.to(x.dtype), v_all.to(x.dtype)
        rope_keys, index_keys = v_all.split([self.dr, self.indexer.D], dim=-1)  # (B, 1, S, dr), (B, 1, S, D)
        seen = visible(pos, k_pos, None)  # (B, 1, T, S)
        top = self.indexer.select(x, iq, index_keys[:, 0], seen[:, 0])  # (B, T, k)
        absorbed = self.path == "absorbed" or (self.path == "auto" and T == 1)
        if absorbed and T == 1:  # decode: attend to the k picked latents only
            y = self.picked_decode(q_nope, q_pe, c_all, rope_keys, k_pos, pos, top[:, 0])  # (B, H, 1, dv)
        else:  # transformers' way: the full attention with every unpicked key masked out
            picked = torch.zeros_like(seen[:, 0]).scatter(-1, top, True)  # (B, T, S)
            mask = seen & picked[:, None]  # (B, 1, T, S)
            y = (self.absorbed if absorbed else self.naive)(q_nope, q_pe, c_all, rope_keys, mask)  # (B, H, T, dv)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.H * self.dv))  # (B, T, hidden)

    def picked_decode(self, q_nope, q_pe, c_all, rope_keys, k_pos, pos, top) -> torch.Tensor:
        """One new token per row over the latents of slots `top` (B, k) alone -> (B, H, 1, dv). A picked slot keeps
        its position, so a slot the row cannot see (picked only when fewer than k are visible) stays masked. Only
        the k picked latents are read, whatever S (the indexer alone reads all S indexer keys): by the C++ kernel
        where they lie in c_all (B, 1, S, r) (the contiguous cache's own storage: no copy), else gathered."""
        B = top.shape[0]
        rows = torch.arange(B, device=top.device)[:, None]  # (B, 1): row b's slots are "block" b of S slots
        k_pos = k_pos.expand(B, -1)[rows, top]  # (B, k)
        kernel = mla_decode_picked() if q_nope.device.type == "cpu" else None
        if kernel is not None:
            table, picks = rows.contiguous(), top.contiguous()  # (B, 1), (B, k)

            def picked(q, c, pe, kp, p, scale):  # absorbed_decode's kernel call, reading slots `picks` of c, pe
                return kernel(q, c, pe, table, picks, kp, p, scale)  # (B, H, r)

            return self.absorbed_decode(q_nope, q_pe, c_all, rope_keys, k_pos, pos, picked)  # (B, H, 1, dv)
        c, pe = c_all[:, 0][rows, top], rope_keys[:, 0][rows, top]  # (B, k, r), (B, k, dr)
        return self.absorbed(q_nope, q_pe, c[:, None], pe[:, None], visible(pos, k_pos, None))  # (B, H, 1, dv)


MIXER = SparseLatentAttention  # kvwall.engine.mixers finds it by the spec's kind
