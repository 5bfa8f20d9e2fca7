"""Lightning attention (MiniMax-01's linear_attention layers): linear attention with a fixed decay per head.

MiniMax, "MiniMax-01: Scaling Foundation Models with Lightning Attention" (2025); the layer as transformers 5.25
runs it (modeling_minimax.py, MiniMaxLightningAttention):

    [q | k | v] = silu(qkv_proj(x))           (B, T, H, 3d): per head q, k, v side by side
    S_t = exp(-s_h) S_{t-1} + k_tᵀ v_t          S: (B, H, d, d); no normalisation, no scale on q
    o_t = q_t S_t                              (B, H, d)
    out = out_proj(rmsnorm(o) · sigmoid(output_gate(x)))   one RMSNorm over all H·d channels (eps 1e-6)

The slopes s_h are fixed, not trained (ALiBi's): s_h = (2^(-8/H))^(h+1) · (1 - l / (n_layers - 1 + 1e-5) + 1e-5)
for layer l, so the last layer barely forgets (its s ~ 1e-5 of the first's). transformers saves them with its
block tables (slope_rate, query_decay, key_decay, diagonal_decay) as buffers; the engine computes them from the
config as transformers' get_slope_rate does and leaves those tensors unread (engine/load.py IGNORED).

``lightning_step`` is the decode step (``lightning_step_`` in place; ``lightning_decode_`` the fast path: the C++
kernel of layers/delta_kernel.py, else the former), ``lightning_reference`` the plain loop and ``lightning_chunked`` the
prefill: transformers' block-wise form (intra-block (QKᵀ ∘ decay) V plus the decayed state read by q; the
state carried from block to block), written with a per-token log decay so that padding (decay 0, k = v = 0)
leaves a row's state unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.layers.delta_kernel import linear_step_
from kvwall.engine.layers.gated_deltanet import _chunks
from kvwall.engine.layers.mixer import SequenceMixer
from kvwall.engine.layers.norm import make_norm
from kvwall.spec.model import LightningAttention as LightningSpec

NORM_EPS = 1e-6  # transformers builds the output RMSNorm without the config's rms_norm_eps: its default 1e-6


def slopes(n_heads: int, index: int, n_layers: int) -> torch.Tensor:
    """(H,) the decay rates of layer `index`, in fp32 as transformers' get_slope_rate computes them."""
    base = 1 / (2 ** (8 / n_heads))
    factor = 1 - index / (n_layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(n_heads, device="cpu") + 1) * factor  # (H,) fp32, on the CPU even under meta


def lightning_step(q, k, v, g, S):
    """One token: q, k, v (B, H, d), g (B, H) the log decay (-s, or 0 for padding), S (B, H, d, d) -> o, new S."""
    S = S * g.exp()[..., None, None] + k[..., None] * v[:, :, None]  # (B, H, d, d)
    return (q[:, :, None] @ S)[:, :, 0], S  # (B, H, d)


def lightning_step_(q, k, v, g, S):
    """lightning_step with S updated in place (the decode fast path: no new state tensor). -> o (B, H, d)."""
    B, H, d, _ = S.shape
    S.mul_(g.exp()[..., None, None])  # (B, H, d, d)
    S.view(B * H, d, d).baddbmm_(k.reshape(B * H, d, 1), v.reshape(B * H, 1, d))  # S += kᵀ v
    return (q[:, :, None] @ S)[:, :, 0]  # (B, H, d)


def lightning_decode_(q, k, v, g, S):
    """The decode fast path (same contract as lightning_step_): one C++ pass over S (layers/delta_kernel.py) where it
    is built and S is fp32 on the CPU, else lightning_step_. -> o (B, H, d)."""
    o = linear_step_(q, k, v, g, S)
    return lightning_step_(q, k, v, g, S) if o is None else o  # (B, H, d)


def lightning_reference(q, k, v, g, S):
    """q, k, v (B, T, H, d), g (B, T, H), S (B, H, d, d) -> o (B, T, H, d), final S; one token at a time."""
    out = []
    for t in range(q.shape[1]):
        o, S = lightning_step(q[:, t], k[:, t], v[:, t], g[:, t], S)
        out.append(o)
    return torch.stack(out, 1), S


def lightning_chunked(q, k, v, g, S, chunk: int = 64):
    """Same contract as lightning_reference; with c_i the cumulative log decay from the block start through token
    i: o_i = exp(c_i) q_i S_0 + Σ_{j<=i} exp(c_i - c_j) (q_i·k_j) v_j and S_end = exp(c_L) S_0 + Σ_j
    exp(c_L - c_j) k_jᵀ v_j (transformers' query_decay, diagonal_decay, key_decay and block_decay)."""
    T = q.shape[1]
    q, k, v = (_chunks(x.transpose(1, 2), chunk) for x in (q, k, v))  # (B, H, c, L, d)
    cum = _chunks(g.transpose(1, 2), chunk).cumsum(-1)  # (B, H, c, L)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # (L, L): j > i
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (B, H, c, L, L)
    within = ((q @ k.transpose(-1, -2)) * decay) @ v  # (B, H, c, L, d): every block's own part at once
    q_dec = q * cum.exp()[..., None]  # (B, H, c, L, d): q reading the block's starting state
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]  # (B, H, c, L, d): each write decayed to the block end
    out, S = [], S.clone()  # S may be the state cache's storage, overwritten by the caller
    for i in range(q.shape[2]):
        out.append(q_dec[:, :, i] @ S + within[:, :, i])  # (B, H, L, d)
        S = S * cum[:, :, i, -1].exp()[..., None, None] + k_dec[:, :, i].transpose(-1, -2) @ v[:, :, i]  # (B,H,d,d)
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :T]  # (B, H, T, d)
    return o.transpose(1, 2), S  # (B, T, H, d), (B, H, d, d)


class Lightning(SequenceMixer):
    """Parameter names are the checkpoint's (qkv_proj, output_gate, norm, out_proj)."""

    hf_module = "self_attn."  # MiniMax: model.layers.N.self_attn.* for both attention kinds

    @classmethod
    def build(cls, m: LightningSpec, spec, index: int) -> Lightning:
        return cls(m, spec.hidden, slopes(m.n_heads, index, spec.n_layers), index)

    @staticmethod
    def checkpoint_names(m: LightningSpec, hf: str, me: str, fused: bool = False) -> dict[str, tuple[str, ...]]:
        names = ("qkv_proj.weight", "output_gate.weight", "norm.weight", "out_proj.weight")
        return {me + n: (hf + n,) for n in names}

    @staticmethod
    def state_shapes(m: LightningSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (0, 0), (m.n_heads, m.head_dim, m.head_dim)  # no conv state; S (H, d, d)

    def __init__(self, spec: LightningSpec, hidden: int, rates: torch.Tensor, index: int):
        super().__init__()
        self.index = index  # which layer of the state cache this mixer reads and writes
        self.H, self.d = spec.n_heads, spec.head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * spec.width, bias=False)
        self.output_gate = nn.Linear(hidden, spec.width, bias=False)
        self.norm = make_norm("rms", spec.width, NORM_EPS)
        self.out_proj = nn.Linear(spec.width, hidden, bias=False)
        self.register_buffer("rate", rates, persistent=False)  # (H,): s_h, computed from the config
        self.chunk = 64  # prefill block (transformers' block_size is 256; the sum is the same in another order)
        self.eager = False  # True: the reference ops only (Transformer.set_eager)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, rope, cache) -> torch.Tensor:
        B, T, _ = x.shape
        S_cache = cache.ssm(self.index).ssm  # (B, H, d, d)
        valid = pos >= 0  # (B, T)
        f = torch.promote_types(x.dtype, torch.float32)  # the state in fp32, or float64 when asked
        qkv = F.silu(self.qkv_proj(x)).to(f) * valid[..., None]  # (B, T, 3·H·d): padding writes nothing
        q, k, v = qkv.unflatten(-1, (self.H, 3 * self.d)).split(self.d, dim=-1)  # (B, T, H, d) each
        g = -self.rate.to(f) * valid[..., None]  # (B, T, H): padding decays nothing
        if T == 1 and not self.eager and S_cache.dtype == f and not torch.is_grad_enabled():
            o = lightning_decode_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], S_cache)[:, None]  # (B, 1, H, d)
        else:
            if T == 1:
                o, S = lightning_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], S_cache.to(f))
                o = o[:, None]  # (B, 1, H, d)
            else:
                o, S = lightning_chunked(q, k, v, g, S_cache.to(f), self.chunk)  # (B, T, H, d)
            S_cache.copy_(S)
        y = self.norm(o.to(x.dtype).flatten(-2))  # (B, T, H·d)
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * y)  # (B, T, hidden)


MIXER = Lightning  # kvwall.engine.mixers finds it by the spec's kind ("lightning")
