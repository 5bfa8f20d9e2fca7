"""Decode attention read in place from the paged pool's blocks (C++, built on first use).

The source is kernels/paged_decode.cpp.

Why: the torch path gathers every row's blocks into a (B, H, S, D) copy per layer and per step
(``pool[table]``, then a reshape that copies again) before attention reads it once more: at batch 16
and ~130 tokens of context, SmolLM2's served step spent 17.0 ms of 131 in aten::index and 7.2 in the
copies, against 9.4 in attention itself (benchmarks/profile_serve_step.py --batch 16, 2026-12-02). The
kernel walks each row's block table and reads every key and value once, where it lies.

PagedCache.attend uses it for a decode step (one new token per row, each the last token its row holds)
over fp32, bf16, fp16 or fp8 (e4m3) pools under an fp32 query, without a softcap or attention sinks, and falls
back to the gather otherwise. serve's integer pools (serve/runner.py, QuantizedPages: int8 / int4 / int2 codes per
token with fp16 scales and zero points) take paged_decode_int the same way: the gather they replace dequantized
every row's blocks into a (B, H, S, D) fp32 copy per layer and step, which made those pools slower than the fp32
one (benchmarks/results/serve_memory_wall.json: 64.8 and 54.9 tok/s against 77.5 at 160 fp32 blocks). The kernel
reads each block's codes once and dequantizes a block's run of tokens in L1 (keys: z + s c, then the dot;
values: the scales folded into the softmax weights, the zero points summed apart, as quantized_decode.cpp does).
Where the (row, KV head) jobs are fewer than about 8 a thread (a long prompt served alone: SmolLM2 has 3 KV
heads), each job is cut along its tokens and the pieces merged exactly (kernels/common.h's cut_jobs, as in the fused
decode step), so both threads work. Prefill chunks stay on the gather: there the copy is 1 / (chunk x rep) of the
attention's own work. A contiguous cache is the same thing with one block per row (ContiguousCache.attend, when
every row's new token is at one position): there it replaces SDPA over a strided slice plus the mask, 29 us a
layer at batch 1 on SmolLM2.
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


@functools.lru_cache(maxsize=1)
def paged_decode_int():
    """The compiled ``paged_decode_int`` of kernels/paged_decode.cpp, or None if it cannot be built."""
    return compiled("paged_decode", "paged_decode_int", "attention over gathered, dequantized blocks (torch)")


FLOAT_POOLS = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)  # what paged_decode reads


def in_place_kernel(q: torch.Tensor, pool: torch.Tensor, softcap: float | None, sink: int, any_float: bool = False):
    """paged_decode when it can take this decode step (fp32 query on the CPU; an fp32 pool, or with `any_float`
    one of FLOAT_POOLS; no softcap, no sinks; a build), else None: the caller's torch path."""
    dtypes = FLOAT_POOLS if any_float else (torch.float32,)
    fits = not softcap and not sink and q.dtype == torch.float32 and pool.dtype in dtypes and q.device.type == "cpu"
    return paged_decode() if fits else None


def int_kernel(q: torch.Tensor, softcap: float | None, sink: int):
    """paged_decode_int when it can take this decode step (fp32 query on the CPU, no softcap, no sinks, a build),
    else None."""
    fits = not softcap and not sink and q.dtype == torch.float32 and q.device.type == "cpu"
    return paged_decode_int() if fits else None


def attend_blocks(kernel, q, kp, vp, table, lengths, window: int | None, scale: float) -> torch.Tensor:
    """q (B, Hq, 1, D) over pools kp (NB, H, bs, D), vp (NB, H, bs, Dv) through block tables (B, nb) holding
    lengths (B,) tokens (the new one written) -> (B, Hq, 1, Dv); query head h reads KV head h // (Hq / H)."""
    B, Hq, _, D = q.shape
    H = kp.shape[1]
    y = kernel(q.reshape(B, H, Hq // H, D).contiguous(), kp, vp, table, lengths, window or 0, scale)
    return y.reshape(B, Hq, 1, vp.shape[3])  # (B, H, rep, Dv) -> (B, Hq, 1, Dv)


def attend_int_blocks(kernel, q, k_parts, v_parts, bits: int, table, lengths, window: int | None,
                      scale: float) -> torch.Tensor:
    """attend_blocks over integer pools: k_parts = [codes (NB, H, bs, D * bits / 8) uint8, scales (NB, H, bs,
    D / g) fp16, (zero points, as the scales)] as QuantizedPages stores them, v_parts likewise -> (B, Hq, 1, Dv)."""
    B, Hq, _, D = q.shape
    H = k_parts[0].shape[1]
    kz = k_parts[2] if len(k_parts) == 3 else None
    vz = v_parts[2] if len(v_parts) == 3 else None
    y = kernel(q.reshape(B, H, Hq // H, D).contiguous(), k_parts[0], k_parts[1], kz, v_parts[0], v_parts[1], vz,
               table, lengths, window or 0, bits, scale)  # (B, H, rep, Dv)
    return y.reshape(B, Hq, 1, y.shape[3])  # (B, Hq, 1, Dv)
