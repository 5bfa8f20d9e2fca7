"""Mamba-2 block: the SSD (state space duality) layer, a selective SSM with a scalar decay per head.

Dao & Gu, "Transformers are SSMs" (2024), section 7 (the Mamba-2 block) and Listing 1 (SSD minimal):

    [z; xBC; δ] = in_proj(x)                  z: (B, T, E), xBC: (B, T, E + 2GN), δ: (B, T, H); E = H·P
    [x; B; C] = silu(conv1d(xBC))             x: (B, T, H, P), B, C: (B, T, G, N); head h uses group h // (H/G)
    Δ   = softplus(δ + dt_bias)               (B, T, H): one step size per head (clamped to dt_limit)
    A   = -exp(A_log)                         (H,): one scalar per head (Mamba-1 has A per channel and state)
    h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_tᵀ   (B, H, P, N): multi-head state
    y_t = h_t C_t + D x_t                     (B, H, P)
    out = out_proj(rmsnorm_grouped(y * silu(z)))

With a scalar decay the scan is a masked "attention" inside a chunk of L tokens:
    y_l = Σ_{s≤l} (C_l·B_s) exp(Σ_{r=s+1..l} Δ_r A) Δ_s x_s  +  C_l·(exp(Σ_{r≤l} Δ_r A) h_start)
so ``ssd_chunked`` does matmuls within chunks and passes the state from chunk to chunk;
``ssd_reference`` is the plain loop and ``ssd_step`` the decode step. Padding gets Δ = 0.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.layers.mamba import causal_conv
from kvwall.engine.layers.mixer import SequenceMixer, ssm_names
from kvwall.engine.layers.norm import GatedRMSNorm
from kvwall.spec.model import Mamba2 as Mamba2Spec


def ssd_reference(x, dt, A, Bm, Cm, h):
    """x (B, T, H, P), dt (B, T, H), A (H,), Bm, Cm (B, T, H, N) (groups expanded), h (B, H, P, N)
    -> y (B, T, H, P) (without the D skip), final h. fp32."""
    ys = []
    for t in range(x.shape[1]):
        dA = torch.exp(dt[:, t] * A)[..., None, None]  # (B, H, 1, 1)
        dBx = (dt[:, t, :, None] * x[:, t])[..., None] * Bm[:, t, :, None, :]  # (B, H, P, N)
        h = dA * h + dBx  # (B, H, P, N)
        ys.append((h * Cm[:, t, :, None, :]).sum(-1))  # (B, H, P)
    return torch.stack(ys, 1), h


def ssd_step(x, dt, A, Bm, Cm, h):
    """One decode step: x (B, H, P), dt (B, H), Bm, Cm (B, H, N), h (B, H, P, N) -> y (B, H, P), new h."""
    dBx = (dt[..., None] * x)[..., None] * Bm[:, :, None, :]  # (B, H, P, N)
    h = torch.addcmul(dBx, torch.exp(dt * A)[..., None, None], h)  # (B, H, P, N)
    return (h @ Cm[..., None])[..., 0], h  # (B, H, P)


def _chunks(t: torch.Tensor, L: int) -> torch.Tensor:
    """(B, T, ...) zero-padded to a multiple of L -> (B, T/L, L, ...)."""
    pad = (-t.shape[1]) % L
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], 1)
    return t.view(t.shape[0], -1, L, *t.shape[2:])


def ssd_chunked(x, dt, A, Bm, Cm, h, chunk: int = 64):
    """Same contract as ssd_reference; matmuls inside chunks of L tokens, a loop over chunks only."""
    T = x.shape[1]
    x, dt, Bm, Cm = (_chunks(t, chunk) for t in (x, dt, Bm, Cm))  # (B, c, L, ...)
    cum = torch.cumsum(dt * A, dim=2)  # (B, c, L, H): log-decay from the chunk start, <= 0
    xdt = x * dt[..., None]  # (B, c, L, H, P)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()  # (L, S)
    gap = (cum[:, :, :, None] - cum[:, :, None]).masked_fill(~causal[:, :, None], float("-inf"))  # (B, c, L, S, H)
    scores = torch.einsum("bclhn,bcshn->bclsh", Cm, Bm) * torch.exp(gap)  # (B, c, L, S, H)
    y = torch.einsum("bclsh,bcshp->bclhp", scores, xdt)  # (B, c, L, H, P): within the chunk
    tail = torch.exp(cum[:, :, -1:] - cum)  # (B, c, L, H): decay from each token to the chunk end
    local = torch.einsum("bclhn,bclh,bclhp->bchpn", Bm, tail, xdt)  # (B, c, H, P, N): chunk's own state
    starts, h = [], h.clone()  # h may be the state cache's storage, overwritten by the caller before a backward
    for k in range(x.shape[1]):
        starts.append(h)
        h = torch.exp(cum[:, k, -1])[..., None, None] * h + local[:, k]  # (B, H, P, N)
    starts = torch.stack(starts, 1)  # (B, c, H, P, N): state entering each chunk
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cm, starts) * torch.exp(cum)[..., None]  # (B, c, L, H, P)
    return y.flatten(1, 2)[:, :T], h  # (B, T, H, P), (B, H, P, N)


def out_bias(m: Mamba2Spec) -> bool:
    """Whether out_proj has a bias: in_proj's (proj_bias) unless the spec says otherwise (Falcon-H1 projectors_bias)."""
    return m.proj_bias if m.out_bias is None else m.out_bias


class Mamba2(SequenceMixer):
    """Parameter names are Hugging Face's (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""

    @classmethod
    def build(cls, m: Mamba2Spec, spec, index: int) -> Mamba2:
        return cls(m, spec.hidden, index, spec.norm_eps)

    @staticmethod
    def checkpoint_names(m: Mamba2Spec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        out = ssm_names(replace(m, proj_bias=False), ["dt_bias"] + (["norm.weight"] if m.gated_norm else []), hf, me)
        for name, has in (("in_proj.bias", m.proj_bias), ("out_proj.bias", out_bias(m))):
            if has:
                out[me + name] = (hf + name,)
        return out

    @staticmethod
    def state_shapes(m: Mamba2Spec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (m.conv_dim, m.d_conv), (m.n_heads, m.head_dim, m.d_state)  # conv (E + 2GN, K), h (H, P, N)

    def __init__(self, spec: Mamba2Spec, hidden: int, index: int, norm_eps: float):
        super().__init__()
        self.index = index  # which layer of the state cache this block reads and writes
        self.H, self.P, self.N, self.G = spec.n_heads, spec.head_dim, spec.d_state, spec.n_groups
        E, conv_dim = spec.d_inner, spec.conv_dim
        self.sizes = [E, conv_dim, self.H]  # z, xBC, δ
        self.dt_limit = spec.dt_limit
        self.in_proj = nn.Linear(hidden, E + conv_dim + self.H, bias=spec.proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, spec.d_conv, groups=conv_dim, bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.H))
        self.A_log = nn.Parameter(torch.zeros(self.H))
        self.D = nn.Parameter(torch.ones(self.H))
        # Falcon-H1 without mamba_rms_norm: y * silu(z) only
        self.norm = GatedRMSNorm(E, E // self.G, norm_eps, spec.norm_before_gate) if spec.gated_norm else None
        self.out_proj = nn.Linear(E, hidden, bias=out_bias(spec))
        scales = spec.in_scales  # Falcon-H1's ssm_multipliers: one per in_proj part z, x, B, C, Δ
        parts = [E, E, self.G * self.N, self.G * self.N, self.H]
        self.register_buffer("in_scale", None if scales is None else torch.cat(
            [torch.full((n,), float(v), device="cpu") for n, v in zip(parts, scales)]),  # built on the CPU, not meta
            persistent=False)  # (2E + 2GN + H,)

    def split(self, xbc: torch.Tensor):
        """(B, T, E + 2GN) -> x (B, T, H, P), B and C (B, T, H, N) with each group repeated for its heads."""
        x, Bm, Cm = xbc.float().split([self.H * self.P, self.G * self.N, self.G * self.N], dim=-1)
        rep = self.H // self.G
        Bm = Bm.unflatten(-1, (self.G, self.N)).repeat_interleave(rep, dim=2)  # (B, T, H, N)
        Cm = Cm.unflatten(-1, (self.G, self.N)).repeat_interleave(rep, dim=2)  # (B, T, H, N)
        return x.unflatten(-1, (self.H, self.P)), Bm, Cm

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope, cache) -> torch.Tensor:
        state = cache.ssm(self.index)  # conv (B, E + 2GN, K), ssm (B, H, P, N)
        valid = pos >= 0  # (B, T)
        zxbcdt = self.in_proj(x)  # (B, T, 2E + 2GN + H)
        if self.in_scale is not None:
            zxbcdt = zxbcdt * self.in_scale.to(zxbcdt.dtype)  # (B, T, 2E + 2GN + H)
        z, xbc, delta = zxbcdt.split(self.sizes, dim=-1)  # (B, T, E), (B, T, E + 2GN), (B, T, H)
        xbc = F.silu(causal_conv(xbc, state.conv, self.conv1d, valid.sum(1)))  # (B, T, E + 2GN)
        u, Bm, Cm = self.split(xbc)
        dt = F.softplus(delta.float() + self.dt_bias.float()).clamp(*self.dt_limit) * valid[..., None]  # (B, T, H)
        A = -torch.exp(self.A_log.float())  # (H,)
        h0 = state.ssm.float()
        if x.shape[1] == 1:
            y, h = ssd_step(u[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], h0)
            y = y[:, None]  # (B, 1, H, P)
        else:
            y, h = ssd_chunked(u, dt, A, Bm, Cm, h0)  # (B, T, H, P)
        state.ssm.copy_(h)
        y = y + u * self.D.float()[:, None]  # (B, T, H, P)
        y = y.flatten(-2).to(x.dtype)  # (B, T, E)
        return self.out_proj(self.norm(y, z) if self.norm is not None else y * F.silu(z))  # (B, T, hidden)


MIXER = Mamba2  # kvwall.engine.mixers finds it by the spec's kind
