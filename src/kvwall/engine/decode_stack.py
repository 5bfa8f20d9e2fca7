"""A decode step's whole layer stack in one C++ call (kernels/decode_stack.cpp), in the fast path.

Why: a decode step of a small model is mostly dispatch. SmolLM2-135M with int4 weights (30 layers) spent 19.6 ms a
step at batch 1, of which its matmuls were 12.7 ms and the rest (norms, rotary, the cache write and attention's
call, residual adds, Python between them) 7.3 ms, for ops whose arithmetic is a few microseconds each
(benchmarks/profile_step_ops.py --weights int4:g128/q8_0 --batch 1, 2026-12-03). The stack runs every layer's ops
in C++ with one call from Python a step: the same ops in the same order as Block.forward, the matmuls through the
same kernels (packed.h's for packed weights, torch's mm for float ones).

When: Transformer.forward takes it for one new token per row, outside autograd, in fp32 on the CPU, when
  - every layer is attention + gated MLP whose modules offer their parts (SequenceMixer.stack_parts): RMSNorm
    (with Gemma's offset and sandwich norms), q/k norms, full-width rotary, SwiGLU or GeGLU (tanh), a window,
    biases; fp32 or packed projections (PackedLinear, nn.Linear, OneDnnLinear: its forward called back);
  - the cache hands over each layer's K/V (KVCache.decode_blocks, a KVView per layer) for a step where each row adds
    one token at its end (rows at different positions too; a padding row at -1 is never written, so its steps run
    layer by layer): fp32 pools (contiguous and paged caches, and the sliding cache's rings: position p written to
    slot S + (p - S) % W after S sinks, every slot held read, since each is in the window), fp8 pools (the fp8
    cache: e4m3 bytes read in place and converted in registers, kernels/pool_rows.h), or the KIVI buffers (int8 /
    int4 / int2: the new token appended to the full-precision residual, attention by kernels/quantized_attend.h's
    attend_part_q, as quantized_decode.cpp's), the chunk a step would flush quantized first
    (QuantizedCache.decode_blocks), or serve's integer pools (int8 / int4 / int2 codes per token: the new token
    quantized in C++ bit for bit as QuantizedPages.write does, the codes read in place as paged_decode_int reads
    them; serve/runner.py's QuantizedPages.decode_blocks).
Each (row, KV head) attention job is cut along its tokens where the jobs are fewer than ~8 a thread (common.h's
cut_jobs, merged exactly by run_pieces), so one KV head at batch 1 (Gemma 3 270M) keeps every thread busy: the
stack no longer waits for a job per thread.
Anything else runs layer by layer, as before; the C++ kernel not building is one such case. The layer-by-layer
path is what tests hold the stack to.

Why the quantized caches too: off the stack they paid the layer-by-layer dispatch again, so the caches that read
fewer bytes were the slower ones: SmolLM2-135M at 1k tokens decoded 65.7 tok/s with the exact cache but 47.7 with
int8 and 50.5 with int4 (issue #43), and the fp8 cache upcast its whole cache to fp32 in torch every step.
benchmarks/bench_stack_caches.py measures each cache on and off the stack (benchmarks/results/stack_caches.json).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvwall.engine.caches.base import KVView
from kvwall.engine.layers.norm import RMSNorm
from kvwall.engine.layers.onednn import OneDnnLinear
from kvwall.engine.layers.packed import PackedLinear


@functools.lru_cache(maxsize=1)
def kernel_module():
    """The compiled kernels/decode_stack.cpp module (Proj, Layer, Stack), or None if it cannot be built."""
    from kvwall.engine.native import build

    built = build("decode_stack", "the layer-by-layer decode step")
    return None if built is None else built[0]


def proj(mod, lin: nn.Module):
    """A projection as the kernel's Proj: packed codes, an fp32 nn.Linear's weight, or an fp32 oneDNN projection's
    forward (called back: one Python call, still no module call around it); None for anything else."""
    p = mod.Proj()
    if isinstance(lin, OneDnnLinear):
        if lin.dtype != torch.float32:
            return None
        p.fn = lin.forward
        return p
    if isinstance(lin, PackedLinear):
        p.q, p.s, p.bits, p.group, p.x8 = lin.q, lin.scale, lin.bits, lin.group, lin.x8
        if lin.zero is not None:
            p.z = lin.zero
        if lin.x8_tiles is not None:
            p.qt, p.st = lin.x8_tiles[:2]
            if lin.x8_tiles[2] is not None:
                p.zt = lin.x8_tiles[2]
    elif type(lin) is nn.Linear and lin.weight.dtype == torch.float32:
        p.w = lin.weight
    else:
        return None
    if lin.bias is not None:
        if lin.bias.dtype != torch.float32:
            return None
        p.b = lin.bias
    return p


def norm_weight(norm: nn.Module | None, eps: float, offset: float):
    """An RMSNorm's fp32 weight when it normalises as the stack's norms do (eps, offset), else False."""
    if norm is None:
        return None
    ok = type(norm) is RMSNorm and norm.eps == eps and norm.offset == offset and norm.weight.dtype == torch.float32
    return norm.weight if ok else False


def layer(mod, block: nn.Module, rope: int, eps: float, offset: float):
    """One block as the kernel's Layer, or None when some part of it is not one the stack runs."""
    mixer, ffn = block.mixer, block.ffn
    if block.alpha_beta is not None:  # MiniMax's post-norm residual: not the stack's x + branch(norm(x))
        return None
    a = mixer.stack_parts() if mixer is not None else None
    m = ffn.stack_parts() if hasattr(ffn, "stack_parts") else None
    if a is None or m is None:
        return None
    out = mod.Layer()
    for name, lin in (("qkv", a.pop("qkv")), ("o", a.pop("o")), ("up", m.pop("up")), ("down", m.pop("down"))):
        p = proj(mod, lin)
        if p is None:
            return None
        setattr(out, name, p)
    norms = dict(norm1=block.mixer_norm, norm2=block.ffn_norm, q_norm=a.pop("q_norm"), k_norm=a.pop("k_norm"),
                 post1=block.post_mixer_norm, post2=block.post_ffn_norm)
    for name, norm in norms.items():
        w = norm_weight(norm, eps, offset)
        if w is False or (w is None and name in ("norm1", "norm2")):
            return None
        if w is not None:
            setattr(out, name, w)
    for name, value in {**a, **m, "rope": rope}.items():
        setattr(out, name, value)
    return out


class DecodeStack:
    """The kernel's Stack over a model's layers, and the checks made at each step (the module doc's "When")."""

    def __init__(self, mod, stack):
        self.mod, self.stack = mod, stack

    @classmethod
    def build(cls, model: nn.Module) -> DecodeStack | None:
        """The stack of `model` (a Transformer), or None when some layer, or the kernel, is not there for it."""
        mod = kernel_module()
        if mod is None or not isinstance(model.norm, RMSNorm) or model.spec.residual_scale != 1.0:
            return None  # the kernel's residual adds take no scale (Granite's residual_multiplier)
        eps, offset = model.norm.eps, model.norm.offset
        stack, layers = mod.Stack(eps, offset), 0
        for i, block in enumerate(model.layers):
            r = model.rope_of_layer[i]
            one = layer(mod, block, -1 if r is None else r, eps, offset)
            if one is None or (r is not None and model.rotary[r].rot_dim != one.d):  # partial rotary: not there
                return None
            stack.add(one)
            layers += 1
        return cls(mod, stack) if layers else None

    def __call__(self, x: torch.Tensor, tables: list, cache) -> torch.Tensor | None:
        """x (B, 1, D) after every layer, or None when this step is not one the stack takes (then x is untouched)."""
        if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        B = x.shape[0]
        blocks = cache.decode_blocks(B)
        if blocks is None:
            return None
        views = blocks.views
        if views.native is None:  # once per cache: the kernel's copy of its views
            views.native = [native_view(self.mod, v) for v in views]
        quantized = blocks.quantized if blocks.quantized is not None else NO_COUNTS
        cos = [t.cos.reshape(B, -1) for t in tables]  # (B, d) each: one position per row
        sin = [t.sin_swapped.reshape(B, -1) for t in tables]
        y = self.stack.step(x.reshape(B, -1).contiguous(), cos, sin, views.native, blocks.table, blocks.lengths,
                            quantized).view(B, 1, -1)
        if blocks.done is not None:
            blocks.done()
        return y


NO_COUNTS = torch.empty(0, dtype=torch.int64)  # step()'s `quantized` where no layer is kivi


def native_view(mod, view: KVView):
    """A KVView as the kernel's KV (its tensors shared, not copied)."""
    kv = mod.KV()
    kv.kind = getattr(mod.Kind, view.kind)
    for name in ("k", "v", "kq", "ks", "kz", "vq", "vs", "vz"):
        t = getattr(view, name)
        if t is not None:
            setattr(kv, name, t)
    kv.bits, kv.ring, kv.sink = view.bits, view.ring, view.sink
    if view.pos is not None:
        kv.pos = view.pos
    kv.window = -1 if view.window is None else view.window
    return kv
