"""Mamba (S6) block: a selective state-space model with a fixed-size state per sequence.

Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces" (2023), Algorithm 2:

    [u; z] = in_proj(x)                                  u, z: (B, T, E), E = d_inner
    u      = silu(conv1d(u))                             causal depthwise conv, kernel K = d_conv
    [δ; B; C] = x_proj(u)                                δ: (B, T, R) (R = dt_rank), B, C: (B, T, N)
    Δ      = softplus(dt_proj(δ))                        (B, T, E): the step size, one per channel
    A      = -exp(A_log)                                 (E, N): input-independent, negative
    h_t    = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t            (B, E, N): Ā = exp(ΔA), B̄ = ΔB (the paper's ZOH/Euler)
    y_t    = C_t h_t + D u_t                             (B, E)
    out    = out_proj(y * silu(z))

Δ, B and C depend on the input: that is the "selective" part. falcon_mamba RMS-normalises δ, B
and C without weights before use; Jamba does the same with weights (Mamba.inner_norms).

Decode is one O(1) step on the layer's fixed state: the last K inputs of the conv (E, K) and
h (E, N). Prefill runs the same recurrence over T tokens: ``scan_reference`` is the plain loop,
``scan_chunked`` a faster torch path (discretise a chunk at once, then one fused multiply-add per step), and
``scan_prefill`` uses the fused C++ kernel of scan_kernel.py when it builds (falling back to scan_chunked), and
``scan_trainable`` when a gradient must flow back (training small models: kvwall.measure.recall; C++ forward and
backward when they build, else a torch Function with a hand-written backward).
Padding (pos = -1) gets Δ = 0: exp(0·A) = 1 and 0·B·u = 0, so the state passes through unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.layers.mixer import SequenceMixer, ssm_names
from kvwall.engine.layers.norm import RMSNorm
from kvwall.engine.layers.scan_kernel import fused_scan, fused_scan_backward
from kvwall.spec.model import Mamba as MambaSpec


def scan_reference(u, dt, A, Bm, Cm, h):
    """The recurrence, one token at a time. u, dt (B, T, E); A (E, N); Bm, Cm (B, T, N); h (B, E, N).
    -> y (B, T, E) (without the D skip), final h (B, E, N). fp32 in, fp32 out."""
    ys = []
    for t in range(u.shape[1]):
        dA = torch.exp(dt[:, t, :, None] * A)  # (B, E, N)
        dBu = dt[:, t, :, None] * Bm[:, t, None, :] * u[:, t, :, None]  # (B, E, N)
        h = dA * h + dBu  # (B, E, N)
        ys.append((h * Cm[:, t, None, :]).sum(-1))  # (B, E)
    return torch.stack(ys, 1), h  # (B, T, E), (B, E, N)


def scan_chunked(u, dt, A, Bm, Cm, h, chunk: int = 16):
    """Same result as scan_reference, faster: per chunk of L tokens, exp(ΔA) and ΔBu are computed in
    one vectorised op each, the recurrence is one fused multiply-add per token into a buffer of the
    chunk's states, and the outputs are one batched matmul. Exact (no log-space rescaling), so
    stable for any Δ."""
    B, T, E = u.shape
    states = torch.empty(chunk, B, E, A.shape[1], dtype=h.dtype, device=h.device)  # (L, B, E, N)
    ys = []
    for s in range(0, T, chunk):
        d = dt[:, s:s + chunk].transpose(0, 1)  # (L, B, E)
        L = d.shape[0]
        dA = torch.exp(d[..., None] * A)  # (L, B, E, N)
        dBu = (d * u[:, s:s + chunk].transpose(0, 1))[..., None] * Bm[:, s:s + chunk].transpose(0, 1)[:, :, None]
        for t in range(L):
            h = torch.addcmul(dBu[t], dA[t], h, out=states[t])  # (B, E, N) = exp(ΔA) h + ΔBu
        c = Cm[:, s:s + chunk].transpose(0, 1).reshape(L * B, -1, 1)  # (L*B, N, 1)
        ys.append(torch.bmm(states[:L].view(L * B, E, -1), c).view(L, B, E).transpose(0, 1))  # (B, L, E)
    return torch.cat(ys, 1), h.clone()  # (B, T, E), (B, E, N)


def scan_trainable(u, dt, A, Bm, Cm, h):
    """Same result as scan_reference, with a gradient (training: kvwall recall): _TrainScan's forward and a
    hand-written backward, each one in-place multiply-add per token over a (T, B, E, N) buffer and a few
    vectorised passes; the caller's h is left untouched (it is the state cache's storage)."""
    return _TrainScan.apply(u, dt, A, Bm, Cm, h)


class _TrainScan(torch.autograd.Function):
    """The recurrence h_t = a_t h_{t-1} + b_t (a = exp(ΔA), b = ΔBu), y_t = C_t h_t, with its backward by hand:
    with G_t = dL/dh_t = gy_t C_t + a_{t+1} G_{t+1} (one reverse loop), dL/db_t = G_t and
    dL/d(ΔA)_t = G_t h_{t-1} a_t, from which Δ, A, B and u get theirs by the chain rule. Autograd through the
    loop kept one graph node per token and ~30 passes over (B, T, E, N); this makes ~15 and no graph.
    On the CPU with float32 the C++ pair (selective_scan and selective_scan_backward) runs instead: states stay in
    registers. Measured, forward + backward of one scan at B 32, T 128, E 128, N 16 (recall's Mamba at width 64),
    one thread on 2 busy cores: 0.31 s through autograd, 0.27 s in torch here (the (T, B, E, N) passes bound it,
    ~12 ms each), 0.020 s in C++ (0.031 s at T 256). A whole training step of recall's Mamba (width 64, batch 32):
    0.83 s -> 0.099 s at 128 tokens, 0.22 s at 256."""

    @staticmethod
    def forward(ctx, u, dt, A, Bm, Cm, h0):
        ctx.fused = None
        if u.device.type == "cpu" and u.dtype == torch.float32 and fused_scan_backward() is not None:
            out = fused_scan()(u, dt, A, Bm, Cm, h0)  # None when the channels are not whole SIMD vectors
            if out is not None:  # the C++ pair: states live in registers, backward recomputes them
                ctx.fused = fused_scan_backward()
                ctx.save_for_backward(u, dt, A, Bm, Cm, h0.clone())  # h0 is the cache's, overwritten next
                return out
        dtT, uT = dt.transpose(0, 1), u.transpose(0, 1)  # (T, B, E): time first, so a token's slice is dense
        CT = Cm.transpose(0, 1)  # (T, B, N)
        dA = torch.exp(dtT[..., None] * A)  # (T, B, E, N)
        states = (dtT * uT)[..., None] * Bm.transpose(0, 1)[:, :, None]  # (T, B, E, N): ΔBu, then h in place
        h = h0
        for t in range(states.shape[0]):
            h = states[t].addcmul_(dA[t], h)  # (B, E, N) = exp(ΔA) h + ΔBu
        y = (states * CT[:, :, None]).sum(-1)  # (T, B, E)
        ctx.save_for_backward(u, dt, A, Bm, Cm, h0, dA, states)
        return y.transpose(0, 1), states[-1].clone()  # (B, T, E), (B, E, N)

    @staticmethod
    def backward(ctx, gy, gh):
        if ctx.fused is not None:
            return ctx.fused(*ctx.saved_tensors, gy, gh)
        u, dt, A, Bm, Cm, h0, dA, states = ctx.saved_tensors
        dtT, uT, BT, CT = dt.transpose(0, 1), u.transpose(0, 1), Bm.transpose(0, 1), Cm.transpose(0, 1)
        gyT = gy.transpose(0, 1)  # (T, B, E)
        G = gyT[..., None] * CT[:, :, None]  # (T, B, E, N): dL/dh_t through y_t only
        G[-1] += gh
        for t in range(G.shape[0] - 2, -1, -1):
            G[t].addcmul_(dA[t + 1], G[t + 1])  # (B, E, N): plus what flows back through h_{t+1}
        g_h0 = G[0] * dA[0]  # (B, E, N)
        X = torch.cat([h0[None], states[:-1]]).mul_(G).mul_(dA)  # (T, B, E, N): dL/d(ΔA) = G h_{t-1} exp(ΔA)
        # products and sums, not einsum or matmul: with T·B tiny matrices both made one copy per token (+50 %)
        g_dtA = (X * A).sum(-1)  # (T, B, E)
        g_A = X.mul_(dtT[..., None]).sum((0, 1))  # (E, N)
        g_dtu = (G * BT[:, :, None]).sum(-1)  # (T, B, E): dL/d(Δu) = Σ_n G B
        g_B = (G * (dtT * uT)[..., None]).sum(2)  # (T, B, N)
        g_C = (states * gyT[..., None]).sum(2)  # (T, B, N)
        g_dt = (g_dtA + g_dtu * uT).transpose(0, 1)  # (B, T, E)
        g_u = (g_dtu * dtT).transpose(0, 1)  # (B, T, E)
        return g_u, g_dt, g_A, g_B.transpose(0, 1), g_C.transpose(0, 1), g_h0


def scan_prefill(u, dt, A, Bm, Cm, h):
    """The fastest exact scan available: the fused C++ kernel on the CPU when it builds, else scan_chunked;
    scan_trainable when a gradient has to flow back through it (neither of the others has a backward)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (u, dt, A, Bm, Cm, h)):
        return scan_trainable(u, dt, A, Bm, Cm, h)
    fused = fused_scan() if u.device.type == "cpu" else None
    out = fused(u, dt, A, Bm, Cm, h) if fused is not None else None
    return out if out is not None else scan_chunked(u, dt, A, Bm, Cm, h)


def scan_step(u, dt, A, Bm, Cm, h):
    """One decode step. u, dt (B, E); Bm, Cm (B, N); h (B, E, N) -> y (B, E), new h."""
    h = torch.addcmul((dt * u)[..., None] * Bm[:, None], torch.exp(dt[..., None] * A), h)  # (B, E, N)
    return torch.bmm(h, Cm[..., None])[..., 0], h  # (B, E), (B, E, N)


def causal_conv(x: torch.Tensor, state: torch.Tensor, conv: nn.Conv1d, lengths: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over [state; x], writing the new state in place.

    x (B, T, C) new inputs; state (B, C, K) the K inputs before them; lengths (B,) valid tokens per row
    (right padding). Token t sees inputs t-K+1..t. The new state is each row's last K valid inputs.
    """
    K, T = state.shape[-1], x.shape[1]
    # Work in (B, T, C), the layout of x: the output is then dense along C, as the scan wants it (a
    # transposed (B, C, T) result would cost the fused scan a full copy of u).
    xs = torch.cat([state.transpose(1, 2), x.to(state.dtype)], dim=1)  # (B, K + T, C)
    w = conv.weight[:, 0].to(x.dtype)  # (C, K)
    y = xs[:, 1:T + 1].to(x.dtype) * w[:, 0]  # (B, T, C): K taps, oldest first (cross-correlation)
    for k in range(1, K):
        y = torch.addcmul(y, xs[:, k + 1:k + 1 + T].to(x.dtype), w[:, k])
    if conv.bias is not None:
        y = y + conv.bias
    # (B, K, 1): the window ending at the last token
    idx = lengths[:, None, None] + torch.arange(K, device=x.device)[:, None]
    state.copy_(xs.gather(1, idx.expand(-1, -1, xs.shape[2])).transpose(1, 2))  # (B, C, K)
    return y  # (B, T, C)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm over the last dim (falcon_mamba's δ, B, C), in fp32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Mamba(SequenceMixer):
    """Parameter names are Hugging Face's (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj)."""

    @classmethod
    def build(cls, m: MambaSpec, spec, index: int) -> Mamba:
        return cls(m, spec.hidden, index)

    @staticmethod
    def checkpoint_names(m: MambaSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        norms = [f"{x}_layernorm.weight" for x in ("dt", "b", "c")] if m.inner_norms else []  # Jamba
        return ssm_names(m, ["x_proj.weight", "dt_proj.weight", "dt_proj.bias", *norms], hf, me)

    @staticmethod
    def state_shapes(m: MambaSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (m.d_inner, m.d_conv), (m.d_inner, m.d_state)  # conv (E, K), h (E, N)

    def __init__(self, spec: MambaSpec, hidden: int, index: int):
        super().__init__()
        self.index = index  # which layer of the state cache this block reads and writes
        E, N, R, K = spec.d_inner, spec.d_state, spec.dt_rank, spec.d_conv
        self.sizes = [R, N, N]
        self.in_proj = nn.Linear(hidden, 2 * E, bias=spec.proj_bias)
        self.conv1d = nn.Conv1d(E, E, K, groups=E, bias=spec.conv_bias)  # weight (E, 1, K)
        self.x_proj = nn.Linear(E, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, E, bias=True)
        self.A_log = nn.Parameter(torch.zeros(E, N))
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, hidden, bias=spec.proj_bias)
        self.eps = spec.inner_norm_eps if spec.weightless_norms else None
        if spec.inner_norms:  # Jamba: the same norms with weights
            self.dt_layernorm, self.b_layernorm, self.c_layernorm = (RMSNorm(n, spec.inner_norm_eps) for n in (R, N, N))
        self.inner_norms = spec.inner_norms

    def selection(self, u: torch.Tensor, valid: torch.Tensor):
        """u (B, T, E) -> Δ (B, T, E) (0 on padding), B, C (B, T, N), all fp32."""
        delta, Bm, Cm = self.x_proj(u).split(self.sizes, dim=-1)  # (B, T, R), (B, T, N) x2
        if self.eps is not None:
            delta, Bm, Cm = rms(delta, self.eps), rms(Bm, self.eps), rms(Cm, self.eps)
        if self.inner_norms:
            delta, Bm, Cm = self.dt_layernorm(delta), self.b_layernorm(Bm), self.c_layernorm(Cm)
        dt = F.softplus(self.dt_proj(delta).float()) * valid[..., None]  # (B, T, E)
        return dt, Bm.float(), Cm.float()

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope, cache) -> torch.Tensor:
        state = cache.ssm(self.index)  # conv (B, E, K), ssm (B, E, N)
        valid = pos >= 0  # (B, T)
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (B, T, E) each
        u = F.silu(causal_conv(u, state.conv, self.conv1d, valid.sum(1)))  # (B, T, E)
        dt, Bm, Cm = self.selection(u, valid)
        A = -torch.exp(self.A_log.float())  # (E, N)
        h0, u32 = state.ssm.float(), u.float()
        if x.shape[1] == 1:
            y, h = scan_step(u32[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], h0)  # (B, E), (B, E, N)
            y = y[:, None]  # (B, 1, E)
        else:
            y, h = scan_prefill(u32, dt, A, Bm, Cm, h0)  # (B, T, E), (B, E, N)
        state.ssm.copy_(h)
        y = (y + u32 * self.D.float()).to(x.dtype) * F.silu(z)  # (B, T, E)
        return self.out_proj(y)  # (B, T, hidden)


MIXER = Mamba  # kvwall.engine.mixers finds it by the spec's kind
