"""Gated DeltaNet: linear attention whose per-head state is edited by the delta rule and decayed by a gate.

Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (2024), eq. 10; the layer
as Qwen3-Next and Qwen3.5 run it (transformers 5.25, modeling_qwen3_next.py / modeling_qwen3_5.py):

    [q; k; v], z, b, a = in_proj(x)            q, k: (B, T, Hk, dk), v, z: (B, T, Hv, dv), b, a: (B, T, Hv)
    [q; k; v] = silu(conv1d([q; k; v]))        a causal depthwise conv of conv_kernel taps over the 2Hk·dk + Hv·dv
                                               channels (its state: the last conv_kernel inputs)
    q, k = l2norm(q), l2norm(k); q *= dk^-½    each key head serves Hv / Hk consecutive value heads
    β_t = sigmoid(b_t)                         (B, T, Hv): how much of the new value is written
    g_t = -exp(A_log) · softplus(a_t + dt_bias)  (B, T, Hv): the log of the state's decay, <= 0
    S_t = exp(g_t) S_{t-1} + k_t ⊗ β_t (v_t - S'_tᵀ k_t),  S'_t = exp(g_t) S_{t-1}      S: (B, Hv, dk, dv)
    o_t = S_tᵀ q_t                             (B, Hv, dv)
    out = out_proj(rmsnorm(o) · w · silu(z))   the gated RMSNorm, one per value head over dv

The delta rule writes v_t - (what the state already returns for k_t): the state is corrected, not summed into;
the papers' claim that this recalls better than a decayed sum of k ⊗ v of the same size (Mamba-2) is what
`kvwall recall`'s gated_deltanet row measures.

``gated_delta_reference`` is the plain loop, ``gated_delta_step`` the decode step (``gated_delta_step_`` the
same in place; ``gated_delta_decode_`` the fast path: the C++ kernel of layers/delta_kernel.py, else the former)
and ``gated_delta_chunked`` the prefill: inside a chunk of L tokens the L delta updates are one
unit-lower-triangular solve (the WY / UT form of the paper's section 3), and only the state passes from chunk to
chunk. Padding gets β = 0 and g = 0:
the state passes through it unchanged. The state is computed in fp32, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.layers.delta_kernel import delta_step_
from kvwall.engine.layers.mamba import causal_conv
from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.engine.layers.mlp import activation
from kvwall.engine.layers.norm import GatedRMSNorm
from kvwall.spec.model import GatedDeltaNet as GatedDeltaNetSpec

L2_EPS = 1e-6  # transformers' l2norm (the FLA library's): x / sqrt(sum x² + 1e-6)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_reference(q, k, v, g, beta, S):
    """q, k (B, T, H, dk) (normalised, q scaled, heads expanded), v (B, T, H, dv), g, beta (B, T, H),
    S (B, H, dk, dv) -> o (B, T, H, dv), final S. fp32, one token at a time."""
    out = []
    for t in range(q.shape[1]):
        o, S = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        out.append(o)
    return torch.stack(out, 1), S


def gated_delta_step(q, k, v, g, beta, S):
    """One token: q, k (B, H, dk), v (B, H, dv), g (B, H) (a decay per head) or (B, H, dk) (per key channel: Kimi
    Delta Attention), beta (B, H), S (B, H, dk, dv) -> o (B, H, dv), new S."""
    S = S * decay(g, S)  # (B, H, dk, dv): decayed
    read = (k[:, :, None] @ S)[:, :, 0]  # (B, H, dv): what the state returns for k
    delta = (v - read) * beta[..., None]  # (B, H, dv): the correction written
    S = torch.addcmul(S, k[..., None], delta[:, :, None])  # (B, H, dk, dv)
    return (q[:, :, None] @ S)[:, :, 0], S  # (B, H, dv)


def decay(g: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """exp(g) shaped to scale S (B, H, dk, dv) row by row: g (B, H) -> (B, H, 1, 1), g (B, H, dk) -> (B, H, dk, 1)."""
    return torch.exp(g).reshape(*S.shape[:2], -1, 1)


def gated_delta_step_(q, k, v, g, beta, S):
    """gated_delta_step with S updated in place, in torch: the decode step where the C++ kernel is not built
    (gated_delta_decode_) and the reference it is held to. Why in place: a fresh (B, H, dk, dv) tensor per op is a
    fresh allocation of the state's size (2 MiB per Qwen3-Next layer at batch 1); in place 36 such layers took
    0.19 s instead of 1.01 s, against 0.047 s for one bare in-place pass over the same states
    (benchmarks/bench_gated_deltanet_step.py, one thread, 2 cores under load 13, 2026-12-06). It still passes
    over S six times (decay, read k, update: read and write, read q): the kernel passes once. -> o (B, H, dv)."""
    B, H, dk, dv = S.shape
    S.mul_(decay(g, S))  # (B, H, dk, dv): decayed
    delta = (v - (k[:, :, None] @ S)[:, :, 0]) * beta[..., None]  # (B, H, dv)
    S.view(B * H, dk, dv).baddbmm_(k.reshape(B * H, dk, 1), delta.reshape(B * H, 1, dv))  # S += k (x) delta
    return (q[:, :, None] @ S)[:, :, 0]  # (B, H, dv)


def gated_delta_decode_(q, k, v, g, beta, S):
    """The decode fast path (same contract as gated_delta_step_): one C++ pass over S (layers/delta_kernel.py) where
    it is built and S is fp32 on the CPU, else gated_delta_step_. -> o (B, H, dv)."""
    o = delta_step_(q, k, v, g, beta, S)
    return gated_delta_step_(q, k, v, g, beta, S) if o is None else o  # (B, H, dv)


def _chunks(t: torch.Tensor, L: int) -> torch.Tensor:
    """(B, H, T, ...) zero-padded to a multiple of L -> (B, H, T/L, L, ...)."""
    pad = (-t.shape[2]) % L
    if pad:
        t = torch.cat([t, t.new_zeros(*t.shape[:2], pad, *t.shape[3:])], 2)
    return t.view(*t.shape[:2], -1, L, *t.shape[3:])


def gated_delta_chunked(q, k, v, g, beta, S, chunk: int = 64):
    """Same contract as gated_delta_reference; matmuls and one triangular solve per chunk, a loop over chunks.

    Inside a chunk, with c_i the cumulative log-decay from the chunk start to token i and D_ij = exp(c_i - c_j)
    (j <= i), the L updates unroll to S_end = exp(c_L) S_0 + Σ_i exp(c_L - c_i) k_i u_iᵀ where the written
    values u solve (I + tril(diag(β) K Kᵀ ∘ D, -1)) u = β (v - exp(c) K S_0): the new values U and the decayed
    keys W of that solve are computed for all chunks at once, then each chunk reads the state left by the last."""
    T = q.shape[1]
    q, k, v = (_chunks(x.transpose(1, 2), chunk) for x in (q, k, v))  # (B, H, c, L, d)
    g, beta = (_chunks(x.transpose(1, 2), chunk) for x in (g, beta))  # (B, H, c, L)
    cum = g.cumsum(-1)  # (B, H, c, L): log-decay from the chunk start, <= 0
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # (L, L): j > i
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (B, H, c, L, L)
    kb = k * beta[..., None]  # (B, H, c, L, dk)
    system = (kb @ k.transpose(-1, -2)) * decay  # (B, H, c, L, L): only its strictly lower part is used
    U = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)  # (.., L, dv)
    W = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)  # dk
    within = (q @ k.transpose(-1, -2)) * decay  # (B, H, c, L, L): token i reads token j's write, j <= i
    q_dec = q * cum.exp()[..., None]  # (B, H, c, L, dk): q reading the chunk's starting state
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]  # (B, H, c, L, dk): each write decayed to the chunk end
    out, S = [], S.clone()  # S may be the state cache's storage, overwritten by the caller
    for i in range(q.shape[2]):
        u = U[:, :, i] - W[:, :, i] @ S  # (B, H, L, dv): the values actually written
        out.append(q_dec[:, :, i] @ S + within[:, :, i] @ u)  # (B, H, L, dv)
        S = S * cum[:, :, i, -1].exp()[..., None, None] + k_dec[:, :, i].transpose(-1, -2) @ u  # (B, H, dk, dv)
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :T]  # (B, H, T, dv)
    return o.transpose(1, 2), S  # (B, T, H, dv), (B, H, dk, dv)


class GatedDeltaNet(SequenceMixer):
    """in_proj holds [q; k; v; z; b; a] (Qwen3.5's four projections) or [qkvz; ba] (Qwen3-Next's two, rows
    grouped per key head), one matmul either way; conv1d, dt_bias, A_log, norm and out_proj keep HF's names."""

    hf_module = "linear_attn."  # Qwen3-Next / Qwen3.5: model.layers.N.linear_attn.*

    @classmethod
    def build(cls, m: GatedDeltaNetSpec, spec, index: int) -> GatedDeltaNet:
        return cls(m, spec.hidden, index, spec.norm_eps)

    @staticmethod
    def checkpoint_names(m: GatedDeltaNetSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        parts = ("in_proj_qkvz", "in_proj_ba") if m.interleaved else ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                        "in_proj_a")
        out = {me + "in_proj.weight": tuple(f"{hf}{p}.weight" for p in parts)}
        return out | {me + n: (hf + n,) for n in ("conv1d.weight", "dt_bias", "A_log", "norm.weight",
                                                  "out_proj.weight")}

    @staticmethod
    def state_shapes(m: GatedDeltaNetSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (m.conv_dim, m.conv_kernel), (m.n_v_heads, m.k_head_dim, m.v_head_dim)  # conv (C, K), S (Hv, dk, dv)

    def __init__(self, spec: GatedDeltaNetSpec, hidden: int, index: int, norm_eps: float):
        super().__init__()
        self.index = index  # which layer of the state cache this mixer reads and writes
        self.Hk, self.Hv, self.dk, self.dv = spec.n_k_heads, spec.n_v_heads, spec.k_head_dim, spec.v_head_dim
        self.interleaved = spec.interleaved
        key, value, C = spec.key_dim, spec.value_dim, spec.conv_dim
        # the checkpoint's parts of in_proj, in order (the loader checks each part's shape against these)
        self.sizes = [2 * key + 2 * value, 2 * self.Hv] if self.interleaved else [C, value, self.Hv, self.Hv]
        self.in_proj = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.conv1d = nn.Conv1d(C, C, spec.conv_kernel, groups=C, bias=False)
        self.act = activation(spec.activation)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = GatedRMSNorm(self.dv, self.dv, norm_eps, before_gate=True, cast_first=True)  # per value head
        self.out_proj = nn.Linear(value, hidden, bias=False)
        self.chunk = 64  # prefill chunk (transformers' chunk_size)
        self.eager = False  # True: the reference ops only (Transformer.set_eager)

    def split(self, p: torch.Tensor):
        """in_proj's output (B, T, ·) -> qkv (B, T, C) in conv order [q; k; v], z (B, T, Hv, dv), b, a (B, T, Hv)."""
        if not self.interleaved:
            qkv, z, b, a = p.split(self.sizes, dim=-1)
            return qkv, z.unflatten(-1, (self.Hv, self.dv)), b, a
        B, T, r = p.shape[0], p.shape[1], self.Hv // self.Hk
        qkvz, ba = p.split(self.sizes, dim=-1)
        q, k, v, z = qkvz.unflatten(-1, (self.Hk, -1)).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        b, a = ba.unflatten(-1, (self.Hk, 2 * r)).split([r, r], -1)  # (B, T, Hk, r) each
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)  # (B, T, C)
        return qkv, z.reshape(B, T, self.Hv, self.dv), b.reshape(B, T, self.Hv), a.reshape(B, T, self.Hv)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope, cache) -> torch.Tensor:
        B, T, _ = x.shape
        state = cache.ssm(self.index)  # conv (B, C, K), ssm: S (B, Hv, dk, dv)
        valid = pos >= 0  # (B, T)
        qkv, z, b, a = self.split(self.in_proj(x))
        qkv = self.act(causal_conv(qkv, state.conv, self.conv1d, valid.sum(1)))  # (B, T, C)
        f = torch.promote_types(x.dtype, torch.float32)  # the rule in fp32 (transformers'), or float64 when asked
        q, k, v = qkv.to(f).split([self.Hk * self.dk, self.Hk * self.dk, self.Hv * self.dv], dim=-1)
        r = self.Hv // self.Hk
        q = l2norm(q.unflatten(-1, (self.Hk, self.dk))).repeat_interleave(r, 2) * self.dk ** -0.5  # (B, T, Hv, dk)
        k = l2norm(k.unflatten(-1, (self.Hk, self.dk))).repeat_interleave(r, 2)  # (B, T, Hv, dk)
        v = v.unflatten(-1, (self.Hv, self.dv))  # (B, T, Hv, dv)
        beta = b.sigmoid().to(f) * valid[..., None]  # (B, T, Hv): padding writes nothing
        g = -self.A_log.to(f).exp() * F.softplus(a.to(f) + self.dt_bias.to(f)) * valid[..., None]  # (B, T, Hv)
        if T == 1 and not self.eager and state.ssm.dtype == f and not torch.is_grad_enabled():
            o = gated_delta_decode_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.ssm)[:, None]  # (B,1,Hv,dv)
        else:
            S0 = state.ssm.to(f)
            if T == 1:
                o, S = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
                o = o[:, None]  # (B, 1, Hv, dv)
            else:
                o, S = gated_delta_chunked(q, k, v, g, beta, S0, self.chunk)  # (B, T, Hv, dv)
            state.ssm.copy_(S)
        y = self.norm(o.to(x.dtype), z)  # (B, T, Hv, dv)
        return self.out_proj(y.flatten(-2))  # (B, T, hidden)


MIXER = GatedDeltaNet  # kvwall.engine.mixers finds it by the spec's kind
