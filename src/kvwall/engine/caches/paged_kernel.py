"""Decode attention read in place from the paged pool's blocks (C++, built on first use).

The source is kernels/paged_decode.cpp.

Why: the torch path gathers every row's blocks into a (B, H, S, D) copy per layer and per step
(``pool[table]``, then a reshape that copies again) before attention reads it once more: at batch 16
and ~130 tokens of context, SmolLM2's served step spent 17.0 ms of 131 in aten::index and 7.2 in the
copies, against 9.4 in attention itself (benchmarks/profile_serve_step.py --batch 16, 2026-12-02). The
kernel walks each row's block table and reads every key and value once, where it lies.

PagedCache.attend uses it for a decode step (one new token per row, each the last token its row holds)
over fp32 pools without a softcap or attention sinks, and falls back to the gather otherwise. A contiguous
cache is the same thing with one block per row (ContiguousCache.attend, when every row's new token is at one
position): there it replaces SDPA over a strided slice plus the mask, 29 us a layer at batch 1 on SmolLM2.
"""

from __future__ import annotations

import functools

import torch

from kvwall.engine.native import compiled


@functools.lru_cache(maxsize=1)
def paged_decode():
    """The compiled ``paged_decode`` of kernels/paged_decode.cpp (arguments documented there), or None if it
    cannot be built."""
    return compiled("paged_decode", "paged_decode", "attention over gathered blocks (torch)")


def in_place_kernel(q: torch.Tensor, pool: torch.Tensor, softcap: float | None, sink: int):
    """paged_decode when it can take this decode step (fp32 query and pool on the CPU, no softcap, no sinks,
    a build), else None: the caller's torch path."""
    fits = not softcap and not sink and q.dtype == pool.dtype == torch.float32 and q.device.type == "cpu"
    return paged_decode() if fits else None


def attend_blocks(kernel, q, kp, vp, table, lengths, window: int | None, scale: float) -> torch.Tensor:
    """q (B, Hq, 1, D) over pools kp (NB, H, bs, D), vp (NB, H, bs, Dv) through block tables (B, nb) holding
    lengths (B,) tokens (the new one written) -> (B, Hq, 1, Dv); query head h reads KV head h // (Hq / H)."""
    B, Hq, _, D = q.shape
    H = kp.shape[1]
    y = kernel(q.reshape(B, H, Hq // H, D).contiguous(), kp, vp, table, lengths, window or 0, scale)
    return y.reshape(B, Hq, 1, vp.shape[3])  # (B, H, rep, Dv) -> (B, Hq, 1, Dv)
