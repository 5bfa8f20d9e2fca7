"""Decode attention read in place from the paged pool's blocks (C++, built on first use).

The source is kernels/paged_decode.cpp.

Why: the torch path gathers every row's blocks into a (B, H, S, D) copy per layer and per step
(``pool[table]``, then a reshape that copies again) before attention reads it once more: at batch 16
and ~130 tokens of context, SmolLM2's served step spent 17.0 ms of 131 in aten::index and 7.2 in the
copies, against 9.4 in attention itself (benchmarks/profile_serve_step.py --batch 16, 2026-12-02). The
kernel walks each row's block table and reads every key and value once, where it lies.

PagedCache.attend uses it for a decode step (one new token per row, each the last token its row holds)
over fp32 pools without a softcap or attention sinks, and falls back to the gather otherwise.
"""

from __future__ import annotations

import functools

from kvwall.engine.native import compiled


@functools.lru_cache(maxsize=1)
def paged_decode():
    """The compiled ``paged_decode`` of kernels/paged_decode.cpp (arguments documented there), or None if it
    cannot be built."""
    return compiled("paged_decode", "paged_decode", "attention over gathered blocks (torch)")
