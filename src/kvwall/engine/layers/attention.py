"""Softmax attention (MHA / GQA / MQA, optional sliding window) over whatever the KV cache returns.

Symbols: B batch, T new tokens, S key slots returned by the cache, Hq query heads,
Hkv key/value heads (Hq = rep * Hkv), D head dim.

Positions drive everything: ``pos`` (B, T) holds each new token's position in its
sequence (-1 for padding) and the cache returns ``k_pos`` (B|1, S), the position held
in each key slot (-1 for empty). A query at position p sees a key at position j when
0 <= j <= p and, for a sliding layer, p - j < window or j < sink (attention sinks, StreamingLLM:
the first `sink` positions stay visible; 0 for every model's own layers). This one rule serves
contiguous, ring-buffer, quantized and paged caches alike, and batches of different lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.engine.layers.norm import RMSNorm
from kvwall.engine.layers.rope import RopeTables, apply_rope, apply_rope_interleaved, rotate
from kvwall.spec.model import Attention as AttentionSpec


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, sink: int = 0,
            chunk: int | None = None) -> torch.Tensor:
    """(B, T) query positions x (B|1, S) key positions -> (B, 1, T, S) bool mask. A chunked layer (Llama 4) also
    needs the key in the query's own chunk of `chunk` positions: j // chunk == p // chunk."""
    qp = q_pos[:, :, None]  # (B, T, 1)
    kp = k_pos[:, None, :]  # (B|1, 1, S)
    mask = (kp >= 0) & (kp <= qp)  # (B, T, S)
    if window:
        mask &= ((qp - kp) < window) | (kp < sink)
    if chunk:
        mask &= (kp // chunk) == (qp // chunk)
    mask |= qp < 0  # padding queries see every slot: finite (unused) output instead of NaN
    return mask[:, None]


def attend_reference(q, k, v, mask, scale: float, softcap: float | None, sinks=None) -> torch.Tensor:
    """Plain softmax(q k^T * scale) v, in fp32: the slow, obviously-correct path. sinks (Hq,): gpt-oss's learned
    logit per head joins each softmax as one more column, whose probability is then dropped (transformers'
    GptOss eager_attention_forward), so a query may give less than all of its attention to the keys."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)  # (B, Hq, S, D)
    v = v.repeat_interleave(rep, dim=1)  # (B, Hq, S, Dv)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, Hq, T, S)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:  # None: every key visible to every query
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, Hq, T, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]  # (B, Hq, T, S): the sink's share dropped
        return (probs @ v.float()).to(q.dtype)  # (B, Hq, T, Dv)
    return (scores.softmax(-1) @ v.float()).to(q.dtype)  # (B, Hq, T, Dv)


def attend_sinks(q, k, v, mask, scale: float, sinks) -> torch.Tensor:
    """attend_reference with sinks, without repeating K/V per query head (gpt-oss: 8 query heads a KV head, so the
    reference copies the whole cache 8 times a layer a step): the rep query heads of a KV head become rep x T rows
    against its one K/V. Same scores, same sink column, in q's dtype -> (B, Hq, T, Dv)."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    qg = q.reshape(B, Hkv, rep * T, D)  # (B, Hkv, rep T, D): heads h = g rep + r, as repeat_interleave pairs them
    scores = (qg @ k.transpose(-1, -2) * scale).view(B, Hkv, rep, T, -1)  # (B, Hkv, rep, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask (B, 1, T, S) -> (B, 1, 1, T, S)
    sink = sinks.to(scores.dtype).view(1, Hkv, rep, 1, 1).expand(B, Hkv, rep, T, 1)  # (B, Hkv, rep, T, 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]  # (B, Hkv, rep, T, S): the sink's share dropped
    y = probs.view(B, Hkv, rep * T, -1) @ v  # (B, Hkv, rep T, Dv)
    return y.view(B, Hq, T, v.shape[-1])  # (B, Hq, T, Dv)


def sdpa(q, k, v, **kw) -> torch.Tensor:
    """torch SDPA; a value head narrower than the query/key head (MLA's naive path: 64 vs 96) is zero-padded
    to it first, since the CPU flash kernel wants equal widths and the fallback materialises every score."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        return F.scaled_dot_product_attention(q, k, F.pad(v, (0, q.shape[-1] - dv)), **kw)[..., :dv]
    return F.scaled_dot_product_attention(q, k, v, **kw)


def attend(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """Fast path: torch SDPA (grouped heads without copying K/V); soft-capping falls back to the reference."""
    if softcap:
        return attend_reference(q, k, v, mask, scale, softcap)
    B, Hq, T, D = q.shape
    rep = Hq // k.shape[1]
    if T == 1 and rep > 1:  # decode: the rep query heads of a group become rep "tokens" against one K/V head
        qg = q.view(B, k.shape[1], rep, D)  # (B, Hkv, rep, D)
        y = sdpa(qg, k, v, attn_mask=mask, scale=scale)  # (B, Hkv, rep, Dv)
        return y.reshape(B, Hq, 1, v.shape[-1])
    return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=rep > 1)


def prefix_start(pos: torch.Tensor, k_pos: torch.Tensor) -> int | None:
    """A first prefill: every row's T new tokens are positions 0..T-1 held in slots s0..s0+T-1, and no other
    slot holds a position below T. -> s0 (0 when the cache's slots come first, S - T for a ring's empty slots
    before the new tokens), or None when the mask is anything else (a later chunk, padding, decode)."""
    T, S = pos.shape[1], k_pos.shape[-1]
    if T == 1 or S < T:
        return None
    first = torch.arange(T, device=pos.device)
    if not bool((pos == first).all()):
        return None
    for s0 in dict.fromkeys((0, S - T)):
        rest = torch.cat([k_pos[:, :s0], k_pos[:, s0 + T:]], 1)
        if bool((k_pos[:, s0:s0 + T] == first).all() and ((rest < 0) | (rest >= T)).all()):
            return s0
    return None


def attend_causal(q, k, v, scale: float, window: int | None = None, sink: int = 0) -> torch.Tensor:
    """T queries over the same T keys (positions 0..T-1), causal: SDPA's causal kernel, which skips the masked
    half. With a window shorter than T, blocks of `window` queries each attend to the keys their band can
    reach (2 x window at most), plus the first `sink` keys (always visible to a later query): about
    2 T window scores instead of T^2, and no T x T mask."""
    rep = q.shape[1] // k.shape[1]
    T = q.shape[2]
    if window is None or window >= T:
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=rep > 1)
    out = []
    for b0 in range(0, T, window):
        b1, k0 = min(T, b0 + window), max(0, b0 - window + 1)
        s = min(sink, k0)  # sink keys left of the band: positions 0..s-1, seen by every query of the block
        keys = torch.cat([torch.arange(s), torch.arange(k0, b1)]).to(q.device)[None]  # (1, s + b1 - k0)
        qp = torch.arange(b0, b1, device=q.device)[:, None]  # (b1 - b0, 1)
        band = (keys <= qp) & ((qp - keys < window) | (keys < sink))  # (b1 - b0, s + b1 - k0)
        kb, vb = torch.cat([k[:, :, :s], k[:, :, k0:b1]], 2), torch.cat([v[:, :, :s], v[:, :, k0:b1]], 2)
        out.append(sdpa(q[:, :, b0:b1], kb, vb, attn_mask=band, scale=scale, enable_gqa=rep > 1))
    return torch.cat(out, 2)


class Attention(SequenceMixer):
    """wqkv holds [q; k; v] fused (one matmul); wo projects heads back to hidden."""

    @classmethod
    def build(cls, m: AttentionSpec, spec, index: int) -> Attention:
        return cls(m, spec.hidden, index, spec.norm_eps, gemma_norm=spec.norm == "rms1p")

    @staticmethod
    def checkpoint_names(m: AttentionSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        """q/k/v_proj joined into wqkv (Phi-3: qkv_proj, already fused), o_proj, optional biases and q/k norms."""
        qkv = (hf + "qkv_proj.weight",) if fused else tuple(hf + f"{x}_proj.weight" for x in "qkv")
        out = {me + "wqkv.weight": qkv}
        if m.qkv_bias:
            out[me + "wqkv.bias"] = tuple(hf + f"{x}_proj.bias" for x in "qkv")
        out[me + "wo.weight"] = (hf + "o_proj.weight",)
        if m.o_bias:
            out[me + "wo.bias"] = (hf + "o_proj.bias",)
        if m.qk_norm:
            out[me + "q_norm.weight"], out[me + "k_norm.weight"] = (hf + "q_norm.weight",), (hf + "k_norm.weight",)
        if m.sinks:
            out[me + "sinks"] = (hf + "sinks",)
        return out

    @staticmethod
    def kv_layout(m: AttentionSpec) -> AttentionSpec:
        return m  # the caches hold exactly its K and V heads

    @staticmethod
    def rotary(m: AttentionSpec) -> tuple:
        return m.rope, m.head_dim

    def __init__(self, spec: AttentionSpec, hidden: int, index: int, norm_eps: float, gemma_norm: bool):
        super().__init__()
        self.index = index  # which layer of the cache this attention reads and writes
        self.n_q, self.n_kv, self.d, self.dv = spec.n_q_heads, spec.n_kv_heads, spec.head_dim, spec.v_head_dim
        self.window = spec.window
        self.softcap = spec.softcap
        self.scale = spec.scale if spec.scale is not None else spec.head_dim ** -0.5
        self.gated = spec.output_gate  # Qwen3-Next: q_proj also gives a sigmoid gate per query channel
        self.split = [self.n_q * self.d, self.n_kv * self.d, self.n_kv * self.dv]  # q, k, v after any gate
        self.sizes = [spec.q_width, *self.split[1:]]  # the checkpoint's parts of wqkv (load.py checks them)
        self.wqkv = nn.Linear(hidden, sum(self.sizes), bias=spec.qkv_bias)
        self.wo = nn.Linear(self.n_q * self.dv, hidden, bias=spec.o_bias)
        self.q_norm = self.k_norm = None
        self.eager = False  # True: the reference ops only (Transformer.set_eager)
        self.chunk = spec.chunk  # Llama 4's chunked layers: a query sees only its own chunk's earlier keys
        self.sinks = nn.Parameter(torch.empty(self.n_q)) if spec.sinks else None  # gpt-oss: a logit per head
        self.l2_eps = norm_eps if spec.l2_qk_norm else None  # Llama 4: weightless RMS norm of q, k after rotary
        self.temperature = spec.temperature  # Llama 4's NoPE layers: (floor_scale, attn_scale)
        self.interleaved = spec.rope is not None and spec.rope.interleaved  # Llama 4: rotary on pairs (x0, x1)
        if spec.qk_norm:
            offset = 1.0 if gemma_norm else 0.0
            self.q_norm = RMSNorm(self.d, norm_eps, offset)
            self.k_norm = RMSNorm(self.d, norm_eps, offset)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope: RopeTables | None, cache) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.wqkv(x)  # (B, T, (Hq + 2 Hkv) D)
        gate = None
        if self.gated:  # q_proj's rows are [q; gate] per head: (B, T, Hq, 2D)
            qg = qkv[..., :self.sizes[0]].unflatten(-1, (self.n_q, 2 * self.d))  # (B, T, Hq, 2D)
            gate = qg[..., self.d:].reshape(B, T, self.n_q * self.d)  # (B, T, Hq D)
            qkv = torch.cat([qg[..., :self.d].flatten(-2), qkv[..., self.sizes[0]:]], -1)  # (B, T, (Hq + 2 Hkv) D)
        if self.eager or self.q_norm is not None or rope is None or self.l2_eps is not None or self.interleaved:
            q, k = self.query_key(qkv, rope)
        else:  # q and k side by side in qkv: one rotation for both heads' groups
            nq, nk = self.split[:2]
            qk = rotate(qkv[..., :nq + nk].unflatten(-1, (self.n_q + self.n_kv, self.d)), rope)  # (B, T, Hq+Hkv, D)
            q, k = qk[:, :, :self.n_q], qk[:, :, self.n_q:]  # (B, T, Hq, D), (B, T, Hkv, D)
        v = qkv[..., sum(self.split[:2]):].unflatten(-1, (self.n_kv, self.dv))  # (B, T, Hkv, Dv)
        if self.temperature is not None:  # 1 + attn_scale log(1 + floor((p + 1) / floor_scale)); padding (-1): 1
            floor_scale, attn_scale = self.temperature
            tune = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # (B, T)
            q = (q * tune[:, :, None, None]).to(q.dtype)  # (B, T, Hq, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if self.chunk or self.sinks is not None:  # a mask or a softmax the fast paths do not have
            y = cache.attend_masked(self.index, q, k, v, pos, self.scale, self.window, self.chunk, self.sinks)
        else:
            y = cache.attend(self.index, q, k, v, pos, self.scale, self.window, self.softcap)  # (B, Hq, T, Dv)
        y = y.transpose(1, 2).reshape(B, T, self.n_q * self.dv)  # (B, T, Hq Dv)
        if gate is not None:
            y = y * torch.sigmoid(gate)  # (B, T, Hq Dv)
        return self.wo(y)  # (B, T, hidden)

    def stack_parts(self) -> dict | None:
        """This layer's part of the fused decode step (engine/decode_stack.py): every op of forward() but a
        softcap or an output gate, which the step does not have (nor chunks, sinks, interleaved rotary, Llama 4's
        weightless q/k norm or temperature)."""
        llama4 = self.l2_eps is not None or self.interleaved or self.temperature is not None
        if self.softcap or self.gated or self.chunk or self.sinks is not None or llama4:
            return None
        return dict(qkv=self.wqkv, o=self.wo, q_norm=self.q_norm, k_norm=self.k_norm, nq=self.n_q, nkv=self.n_kv,
                    d=self.d, dv=self.dv, window=self.window or 0, scale=self.scale)

    def query_key(self, qkv: torch.Tensor, rope: RopeTables | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k each on its own: q/k norms first (Qwen3, Gemma 3), then the reference rotation."""
        B, T, _ = qkv.shape
        q, k, _ = qkv.split(self.split, dim=-1)
        q = q.view(B, T, self.n_q, self.d)  # (B, T, Hq, D)
        k = k.view(B, T, self.n_kv, self.d)  # (B, T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None and self.interleaved:  # pairs out as [x0'.., x1'..]: q.k unchanged (same order in both)
            q, k = apply_rope_interleaved(q, rope.cos, rope.sin), apply_rope_interleaved(k, rope.cos, rope.sin)
        elif rope is not None:
            turn = (lambda x: apply_rope(x, rope.cos, rope.sin)) if self.eager else (lambda x: rotate(x, rope))
            q, k = turn(q), turn(k)
        if self.l2_eps is not None:  # Llama 4: after the rotation, as transformers does it
            q, k = weightless_rms(q, self.l2_eps), weightless_rms(k, self.l2_eps)
        return q, k


def weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the head dim, in fp32 (Llama 4's Llama4TextWeightlessRMSNorm)."""
    xf = x.float()  # (B, T, H, D)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


MIXER = Attention  # kvwall.engine.mixers finds it by the spec's kind
