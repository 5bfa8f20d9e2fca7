"""Multi-head latent attention (MLA, DeepSeek-V2 section 2.1; DeepSeek-V3), with two decode paths.

Symbols (the paper's, with the checkpoint's tensor names):
    h          the block input (B, T, hidden)
    c          = RMSNorm(W_DKV h), the latent (kv_lora_rank = r)               kv_a_proj_with_mqa, kv_a_layernorm
    k_pe       = RoPE(W_KR h), the rope key, shared by all heads (d_r)        the same projection's last d_r
    q_i        = [q_nope_i (d_n) ; RoPE(q_pe_i) (d_r)] per head i             q_proj, or q_a_proj/q_a_layernorm/q_b_proj
    W_UK_i, W_UV_i  the up-projections of head i (d_n x r, d_v x r)           kv_b_proj, rows per head [W_UK_i; W_UV_i]
    k_i        = [W_UK_i c ; k_pe],  v_i = W_UV_i c
The cache keeps only (c, k_pe) per token: r + d_r numbers per layer, whatever the head count.

naive:     every step up-projects all S cached latents to K (H, S, d_n + d_r) and V (H, S, d_v),
           then attends as ordinary multi-head attention.
absorbed:  q_nope_i . (W_UK_i c_j) = (W_UK_i^T q_nope_i) . c_j and sum_j p_j W_UV_i c_j = W_UV_i sum_j p_j c_j:
           fold W_UK into the query, attend over the latent itself (an MQA with one r + d_r key and
           an r-wide value per token), and apply W_UV to the attended latent.
Both give the same numbers (tests hold them together); `path` picks one: "auto" (absorbed for
one new token per row, naive otherwise), "naive" or "absorbed".
"""

from __future__ import annotations

import torch
from torch import nn

from kvwall.engine.layers.attention import attend, attend_causal, prefix_start, visible
from kvwall.engine.layers.latent_kernel import mla_decode
from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.engine.layers.norm import RMSNorm
from kvwall.engine.layers.rope import apply_rope_interleaved, rotate
from kvwall.errors import KvwallError
from kvwall.spec.model import Attention as AttentionSpec, LatentAttention as LatentSpec

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use the RMSNorm default, not rms_norm_eps
PATHS = ("auto", "naive", "absorbed")


class LatentAttention(SequenceMixer):
    @classmethod
    def build(cls, m: LatentSpec, spec, index: int) -> LatentAttention:
        return cls(m, spec.hidden, index)

    @staticmethod
    def checkpoint_names(m: LatentSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        """DeepSeek-V2/V3 self_attn: q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a, kv_a_layernorm, kv_b, o."""
        q_lora = [("q_a_proj", "wq_a"), ("q_a_layernorm", "q_norm"), ("q_b_proj", "wq_b")]
        pairs = (q_lora if m.q_lora_rank else [("q_proj", "wq")]) + [
            ("kv_a_proj_with_mqa", "wkv_a"), ("kv_a_layernorm", "kv_norm"), ("kv_b_proj", "wkv_b"), ("o_proj", "wo")]
        out = {f"{me}{mine}.weight": (f"{hf}{theirs}.weight",) for theirs, mine in pairs}
        if m.bias:
            biased = [("kv_a_proj_with_mqa", "wkv_a"), ("o_proj", "wo")] + (
                [("q_a_proj", "wq_a")] if m.q_lora_rank else [])
            out.update({f"{me}{mine}.bias": (f"{hf}{theirs}.bias",) for theirs, mine in biased})
        return out

    @staticmethod
    def kv_layout(m: LatentSpec) -> AttentionSpec:
        """What the caches hold: one "head" whose k is the latent c_kv (r wide) and whose v is the rope key
        k_pe (d_r wide), so the caches that hold K/V by shape hold exactly MLA's latent cache."""
        return AttentionSpec(m.n_heads, 1, m.kv_lora_rank, m.qk_rope_head_dim)

    @staticmethod
    def rotary(m: LatentSpec) -> tuple:
        return m.rope, m.qk_rope_head_dim

    def __init__(self, spec: LatentSpec, hidden: int, index: int):
        super().__init__()
        self.index = index  # which layer of the cache this attention reads and writes
        self.H, self.r = spec.n_heads, spec.kv_lora_rank
        self.dn, self.dr, self.dv = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.scale = spec.scale if spec.scale is not None else spec.qk_head_dim ** -0.5
        self.interleaved = spec.rope is not None and spec.rope.interleaved
        self.path = "auto"
        q_out = self.H * (self.dn + self.dr)
        self.wq = nn.Linear(hidden, q_out, bias=False) if not spec.q_lora_rank else None
        self.wq_a = nn.Linear(hidden, spec.q_lora_rank, bias=spec.bias) if spec.q_lora_rank else None
        self.q_norm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS) if spec.q_lora_rank else None
        self.wq_b = nn.Linear(spec.q_lora_rank, q_out, bias=False) if spec.q_lora_rank else None
        self.wkv_a = nn.Linear(hidden, self.r + self.dr, bias=spec.bias)
        self.kv_norm = RMSNorm(self.r, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.r, self.H * (self.dn + self.dv), bias=False)
        self.wo = nn.Linear(self.H * self.dv, hidden, bias=spec.bias)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: tuple | None, cache) -> torch.Tensor:
        B, T, _ = x.shape
        q_nope, q_pe = self.query(x)  # (B, T, H, dn), (B, T, H, dr)
        c, rope_key = self.wkv_a(x).split([self.r, self.dr], dim=-1)  # (B, T, r), (B, T, dr): c_kv, k_pe
        c, rope_key = self.kv_norm(c), rope_key[:, :, None]  # (B, T, r), (B, T, 1, dr)
        if rope is not None:
            q_pe, rope_key = self.rotate(q_pe, rope), self.rotate(rope_key, rope)
        # the cache's K/V contract with one head: its k holds the latent, its v the rope key (kv_layout)
        c_all, rope_keys, k_pos = cache.update(self.index, c[:, None], rope_key.transpose(1, 2), pos)  # (B,1,S,r|dr)
        c_all, rope_keys = c_all.to(x.dtype), rope_keys.to(x.dtype)
        absorbed = self.path == "absorbed" or (self.path == "auto" and T == 1)
        kernel = mla_decode() if absorbed and T == 1 and x.device.type == "cpu" else None
        if kernel is not None:  # decode: one C++ pass over the latent cache
            y = self.absorbed_decode(q_nope, q_pe, c_all, rope_keys, k_pos, pos, kernel)  # (B, H, 1, dv)
        elif not absorbed and (s0 := prefix_start(pos, k_pos)) is not None:  # a first prefill: plain causal
            y = self.naive(q_nope, q_pe, c_all[:, :, s0:s0 + T], rope_keys[:, :, s0:s0 + T], None)  # (B, H, T, dv)
        else:
            mask = visible(pos, k_pos, None)  # (B, 1, T, S)
            y = (self.absorbed if absorbed else self.naive)(q_nope, q_pe, c_all, rope_keys, mask)  # (B, H, T, dv)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.H * self.dv))  # (B, T, hidden)

    def query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))  # (B, T, H * (dn + dr))
        q = q.view(*x.shape[:2], self.H, self.dn + self.dr)  # (B, T, H, dn + dr)
        return q.split([self.dn, self.dr], dim=-1)

    def rotate(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        return apply_rope_interleaved(x, rope.cos, rope.sin) if self.interleaved else rotate(x, rope)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, dn, r) and W_UV (H, dv, r): views of kv_b_proj's rows, head by head."""
        w = self.wkv_b.weight.view(self.H, self.dn + self.dv, self.r)
        return w[:, :self.dn], w[:, self.dn:]

    def naive(self, q_nope, q_pe, c, rope_key, mask) -> torch.Tensor:
        """Up-project the S cached latents to per-head K and V, then ordinary attention -> (B, H, T, dv).
        mask None: the T queries and S = T keys are one causal prefix."""
        B, _, S, _ = c.shape
        kv = self.wkv_b(c[:, 0]).view(B, S, self.H, self.dn + self.dv).transpose(1, 2)  # (B, H, S, dn + dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)  # (B, H, S, dn), (B, H, S, dv)
        k = torch.cat([k_nope, rope_key.expand(B, self.H, S, self.dr)], dim=-1)  # (B, H, S, dn + dr)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # (B, H, T, dn + dr)
        return attend_causal(q, k, v, self.scale) if mask is None else attend(q, k, v, mask, self.scale, None)

    def absorbed(self, q_nope, q_pe, c, rope_key, mask) -> torch.Tensor:
        """Attention in latent space: W_UK folded into q, W_UV applied after -> (B, H, T, dv)."""
        B, T, H, _ = q_nope.shape
        S = c.shape[2]
        w_uk, w_uv = self.up_weights()
        q_lat = torch.einsum("bthd,hdr->bhtr", q_nope, w_uk).reshape(B, H * T, self.r)  # (B, H*T, r)
        q_rot = q_pe.transpose(1, 2).reshape(B, H * T, self.dr)  # (B, H*T, dr)
        scores = q_lat @ c[:, 0].transpose(1, 2) + q_rot @ rope_key[:, 0].transpose(1, 2)  # (B, H*T, S)
        scores = (scores * self.scale).view(B, H, T, S).masked_fill(~mask, float("-inf"))
        p = scores.float().softmax(-1).to(c.dtype).view(B, H * T, S)  # (B, H*T, S)
        o_lat = (p @ c[:, 0]).view(B, H, T, self.r)  # (B, H, T, r): the attended latent
        return torch.einsum("bhtr,hvr->bhtv", o_lat, w_uv)  # (B, H, T, dv)

    def absorbed_decode(self, q_nope, q_pe, c, rope_key, k_pos, pos, kernel) -> torch.Tensor:
        """The absorbed path for one new token per row through latent_kernel.py -> (B, H, 1, dv)."""
        w_uk, w_uv = self.up_weights()
        q_lat = torch.einsum("bhd,hdr->bhr", q_nope[:, 0], w_uk)  # (B, H, r)
        q = torch.cat([q_lat, q_pe[:, 0]], dim=-1).float().contiguous()  # (B, H, r + dr)
        o_lat = kernel(q, c[:, 0].float(), rope_key[:, 0].float(), k_pos.to(torch.int64).contiguous(),
                       pos[:, 0].to(torch.int64).contiguous(), self.scale)  # (B, H, r)
        return torch.einsum("bhr,hvr->bhv", o_lat.to(c.dtype), w_uv)[:, :, None]  # (B, H, 1, dv)


def set_path(model: nn.Module, path: str) -> None:
    """Every MLA layer of `model` uses `path` ("auto", "naive" or "absorbed") from now on."""
    if path not in PATHS:
        raise KvwallError(f"MLA path {path!r} is not one of {', '.join(PATHS)}")
    for m in model.modules():
        if isinstance(m, LatentAttention):
            m.path = path


MIXER = LatentAttention  # kvwall.engine.mixers finds it by the spec's kind
