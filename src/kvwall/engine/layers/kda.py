"""Kimi Delta Attention (Kimi Linear's KDA layers): Gated DeltaNet whose decay is a vector over the key channels.

Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture" (2025); the layer as transformers 5.25
runs it (modeling_kimi_linear.py, KimiLinearDeltaAttention and its torch reference functions
recurrent_kimi_delta_attention / chunk_kimi_delta_attention):

    q, k, v = q_proj(x), k_proj(x), v_proj(x)       (B, T, H·d) each, no bias
    [q; k; v] = silu(conv1d([q; k; v]))             one causal depthwise conv of conv_kernel taps over 3·H·d
                                                    channels (saved as q_conv1d, k_conv1d, v_conv1d)
    q, k = l2norm(q), l2norm(k); q *= d^-½          per head
    g_t = -exp(A_log_h) · softplus(f_b(f_a(x)) + dt_bias)   (B, T, H, d): the log decay per key channel, <= 0
    β_t = sigmoid(b_proj(x))                        (B, T, H)
    S_t = Diag(exp(g_t)) S_{t-1};  S_t += k_t ⊗ β_t (v_t - S_tᵀ k_t)   S: (B, H, d, d), rows are key channels
    o_t = S_tᵀ q_t
    out = o_proj(rmsnorm(o) · w · sigmoid(g_b(g_a(x))))   a gated RMSNorm per head over d (sigmoid, not silu)

The decode step is Gated DeltaNet's with g (B, H, d) in place of g (B, H): gated_deltanet.gated_delta_step and
its fast path gated_delta_decode_ (the C++ kernel of layers/delta_kernel.py) take either, so the decay costs no
pass of its own over S. The chunked prefill cannot reuse
gated_delta_chunked: there the decay between two tokens is one number per head, here one per key channel, so
the within-chunk matrices carry a d axis (transformers' decay_mask is (.., L, L, d) too); built chunk by chunk
(L·L·d per head: 2 MiB at L = 64 and Kimi-Linear's d = 128 in fp32, 64 MiB for its 32 heads at batch 1) rather
than for the whole prompt at once (a 4k-token prompt would need 4 GiB).
Padding gets β = 0 and g = 0: the state passes through it unchanged. The rule runs in fp32, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.layers.gated_deltanet import _chunks, gated_delta_decode_, gated_delta_step, l2norm
from kvwall.engine.layers.mamba import causal_conv
from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.engine.layers.norm import GatedRMSNorm
from kvwall.spec.model import KimiDeltaAttention as KdaSpec

SOFTPLUS_LINEAR = 20.0  # transformers' forget gate: softplus(x) taken as x above 20 (exp(20) would still be finite)


def kda_step(q, k, v, g, beta, S):
    """One token: q, k (B, H, d), v (B, H, dv), g (B, H, d), beta (B, H), S (B, H, d, dv) -> o (B, H, dv), new S:
    Gated DeltaNet's step with each key channel's row of S decayed by its own gate."""
    return gated_delta_step(q, k, v, g, beta, S)


def kda_reference(q, k, v, g, beta, S):
    """The plain loop, one token at a time: q, k (B, T, H, d), v (B, T, H, dv), g (B, T, H, d), beta (B, T, H)."""
    out = []
    for t in range(q.shape[1]):
        o, S = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        out.append(o)
    return torch.stack(out, 1), S


def kda_chunked(q, k, v, g, beta, S, chunk: int = 64):
    """Same contract as kda_reference; per chunk of L tokens one unit-lower-triangular solve, as
    gated_deltanet.gated_delta_chunked, with cum (.., L, d) the per-channel cumulative log-decay: token j's key
    seen from token i >= j is k_j ∘ exp(cum_i - cum_j), so the chunk's L x L matrices sum over d with that factor."""
    T = q.shape[1]
    q, k, v, g = (_chunks(x.transpose(1, 2), chunk) for x in (q, k, v, g))  # (B, H, c, L, d)
    beta = _chunks(beta.transpose(1, 2), chunk)  # (B, H, c, L)
    cum = g.cumsum(-2)  # (B, H, c, L, d): log-decay from the chunk start, <= 0
    kb = k * beta[..., None]  # (B, H, c, L, d)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # (L, L): j > i
    out, S = [], S.clone()  # S may be the state cache's storage, overwritten by the caller
    for i in range(q.shape[2]):
        c = cum[:, :, i]  # (B, H, L, d)
        # (B, H, L, L, d): exp(cum_i - cum_j) for j <= i; -inf above the diagonal so exp never overflows
        decay = (c[:, :, :, None] - c[:, :, None]).masked_fill(upper[..., None], float("-inf")).exp()
        system = torch.einsum("bhid,bhjd,bhijd->bhij", kb[:, :, i], k[:, :, i], decay)  # (B, H, L, L)
        U = torch.linalg.solve_triangular(system, v[:, :, i] * beta[:, :, i, :, None], upper=False,
                                          unitriangular=True)  # (B, H, L, dv)
        W = torch.linalg.solve_triangular(system, kb[:, :, i] * c.exp(), upper=False, unitriangular=True)  # (.., d)
        within = torch.einsum("bhid,bhjd,bhijd->bhij", q[:, :, i], k[:, :, i], decay)  # (B, H, L, L), j <= i
        u = U - W @ S  # (B, H, L, dv): the values actually written
        out.append((q[:, :, i] * c.exp()) @ S + within @ u)  # (B, H, L, dv)
        k_end = k[:, :, i] * (c[:, :, -1:] - c).exp()  # (B, H, L, d): each write decayed to the chunk end
        S = S * c[:, :, -1, :, None].exp() + k_end.transpose(-1, -2) @ u  # (B, H, d, dv)
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :T]  # (B, H, T, dv)
    return o.transpose(1, 2), S  # (B, T, H, dv), (B, H, d, dv)


class KimiDeltaAttention(SequenceMixer):
    """q/k/v_proj fused into qkv, the three saved convs into one conv1d; the rest keeps the checkpoint's names."""

    hf_module = "self_attn."  # Kimi Linear: model.layers.N.self_attn.* for both KDA and MLA layers

    @classmethod
    def build(cls, m: KdaSpec, spec, index: int) -> KimiDeltaAttention:
        return cls(m, spec.hidden, index, spec.norm_eps)

    @staticmethod
    def checkpoint_names(m: KdaSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        out = {me + "qkv.weight": tuple(f"{hf}{p}_proj.weight" for p in "qkv"),
               me + "conv1d.weight": tuple(f"{hf}{p}_conv1d.weight" for p in "qkv")}
        names = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log", "b_proj.weight", "g_a_proj.weight",
                 "g_b_proj.weight", "o_norm.weight", "o_proj.weight")
        return out | {me + n: (hf + n,) for n in names}

    @staticmethod
    def state_shapes(m: KdaSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (m.conv_dim, m.conv_kernel), (m.n_heads, m.head_dim, m.head_dim)  # conv (3·H·d, K), S (H, d, d)

    def __init__(self, spec: KdaSpec, hidden: int, index: int, norm_eps: float):
        super().__init__()
        self.index = index  # which layer of the state cache this mixer reads and writes
        self.H, self.d = spec.n_heads, spec.head_dim
        w, C = spec.qkv_dim, spec.conv_dim
        self.qkv = nn.Linear(hidden, 3 * w, bias=False)
        self.conv1d = nn.Conv1d(C, C, spec.conv_kernel, groups=C, bias=False)
        self.f_a_proj = nn.Linear(hidden, self.d, bias=False)  # the forget gate's low-rank legs
        self.f_b_proj = nn.Linear(self.d, w, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(w))  # per channel
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.H, 1))  # per head, in the checkpoint's shape
        self.b_proj = nn.Linear(hidden, self.H, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.d, bias=False)  # the output gate's low-rank legs
        self.g_b_proj = nn.Linear(self.d, w, bias=False)
        self.o_norm = GatedRMSNorm(self.d, self.d, norm_eps, before_gate=True, act=torch.sigmoid)  # per head, fp32
        self.o_proj = nn.Linear(w, hidden, bias=False)
        self.chunk = 64  # prefill chunk (transformers' chunk_size)
        self.eager = False  # True: the reference ops only (Transformer.set_eager)

    def gate(self, x: torch.Tensor, f) -> torch.Tensor:
        """x (B, T, hidden) -> g (B, T, H, d) in dtype f: -exp(A_log) · softplus(f_b(f_a(x)) + dt_bias)."""
        a = (self.f_b_proj(self.f_a_proj(x)).to(f) + self.dt_bias.to(f)).unflatten(-1, (self.H, self.d))
        soft = torch.where(a > SOFTPLUS_LINEAR, a, torch.log1p(torch.exp(a)))  # (B, T, H, d)
        return -self.A_log.to(f).exp() * soft

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope, cache) -> torch.Tensor:
        B, T, _ = x.shape
        state = cache.ssm(self.index)  # conv (B, 3·H·d, K), ssm: S (B, H, d, d)
        valid = pos >= 0  # (B, T)
        qkv = F.silu(causal_conv(self.qkv(x), state.conv, self.conv1d, valid.sum(1)))  # (B, T, 3·H·d)
        f = torch.promote_types(x.dtype, torch.float32)  # the rule in fp32 (transformers'), or float64 when asked
        q, k, v = (t.to(f).unflatten(-1, (self.H, self.d)) for t in qkv.chunk(3, dim=-1))  # (B, T, H, d) each
        q, k = l2norm(q) * self.d ** -0.5, l2norm(k)
        g = self.gate(x, f) * valid[..., None, None]  # (B, T, H, d): padding decays nothing
        beta = self.b_proj(x).sigmoid().to(f) * valid[..., None]  # (B, T, H): padding writes nothing
        if T == 1 and not self.eager and state.ssm.dtype == f and not torch.is_grad_enabled():
            o = gated_delta_decode_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.ssm)[:, None]  # (B,1,H,d)
        else:
            S0 = state.ssm.to(f)
            if T == 1:
                o, S = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
                o = o[:, None]  # (B, 1, H, d)
            else:
                o, S = kda_chunked(q, k, v, g, beta, S0, self.chunk)  # (B, T, H, d)
            state.ssm.copy_(S)
        z = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.H, self.d))  # (B, T, H, d)
        y = self.o_norm(o.to(x.dtype), z)  # (B, T, H, d)
        return self.o_proj(y.flatten(-2))  # (B, T, hidden)


MIXER = KimiDeltaAttention  # kvwall.engine.mixers finds it by the spec's kind ("kda")
