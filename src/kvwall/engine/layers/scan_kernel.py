"""A fused selective scan for Mamba prefill on the CPU: the recurrence of ``scan_reference`` in one C++ loop.

    for each (b, e), in parallel:  for t:  for n:
        h[n] = exp(Δ_t A[e, n]) h[n] + Δ_t u_t B_t[n]        y_t = Σ_n C_t[n] h[n]

Why C++: at prefill the recurrence is ~T·E·N fused multiply-adds of elementwise work; any exact form
built from torch ops makes several passes over (E, N) per token, and parallel (segment-sum) forms do
more work still. One loop keeps h in registers/L1 and touches each input once. Each block walks a
column of (T, E) rows kilobytes apart, which the hardware prefetcher does not follow, so the loop
prefetches a few tokens ahead itself. Its source is kernels/selective_scan.cpp, built on first use
(kvwall.engine.native); when it cannot be built, ``fused_scan()`` returns None and the engine uses
``scan_chunked``.
"""

from __future__ import annotations

import functools

import torch

from kvwall.engine.native import build, simd_width


@functools.lru_cache(maxsize=1)
def fused_scan():
    """The compiled scan (same signature and result as scan_reference), or None if it cannot be built."""
    built = build("selective_scan", "scan_chunked (torch)")
    if built is None:
        return None  # the torch path stays correct, just slower
    mod, flags = built
    width = simd_width(flags)  # the kernel works in whole SIMD vectors of channels

    def scan(u, dt, A, Bm, Cm, h):
        if u.shape[-1] % width:
            return None  # the caller falls back to the torch path
        dense_last = [x.float() if x.stride(-1) == 1 else x.float().contiguous() for x in (u, dt, Bm, Cm)]
        u_, dt_, b_, c_ = dense_last
        y, h_out = mod.selective_scan(u_, dt_, A.float().t().contiguous(), b_, c_, h.float().contiguous())
        return y, h_out  # (B, T, E), (B, E, N)

    return scan


@functools.lru_cache(maxsize=1)
def fused_scan_backward():
    """The compiled backward of the scan (training, kvwall recall): (u, dt, A, Bm, Cm, h, gy, gh) -> the gradients
    of u, dt, A, Bm, Cm and h, or None when the kernel cannot be built or serve these shapes."""
    built = build("selective_scan", "the torch training scan")
    if built is None:
        return None
    mod, flags = built
    width = simd_width(flags)

    def backward(u, dt, A, Bm, Cm, h, gy, gh):
        if u.shape[-1] % width or u.dtype != torch.float32:
            return None
        dense = [x.float().contiguous() for x in (u, dt, A.t(), Bm, Cm, h, gy, gh)]
        gu, gdt, gA, gB, gC, gh0 = mod.selective_scan_backward(*dense)
        # (B, N, E) per batch row -> (E, N); (B, T, blocks, N) per channel block -> (B, T, N)
        return gu, gdt, gA.sum(0).t(), gB.sum(2), gC.sum(2), gh0

    return backward
