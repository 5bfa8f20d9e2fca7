"""Paged cache (vLLM's PagedAttention, nano-vllm's BlockManager): K/V live in fixed-size blocks from a pool.

Each row (sequence) has a block table: logical block i of the row -> physical block in the
pool. A row grows one block at a time; when a sequence finishes, release() returns its blocks
to the free list, and the row can start a new sequence. One table serves every layer.

Bytes: nbytes() is the blocks allocated to live rows, ceil(len / block_size) per row, times
the bytes of one block in all layers = predict.memory(spec.with_window(None), batch=1,
context=len, block_size=...).cache_bytes summed over rows. Internal waste (allocated minus
used) is below one block per row. pool_bytes() is the whole preallocated pool.
Sliding windows only mask here; every layer keeps every token.
A decode step over fp32 pools (or bf16, fp16, fp8 ones under an fp32 query) attends in place, walking each row's
block table in C++ (paged_kernel.py); everything else gathers each row's blocks into a (B, H, S, D) copy first.
"""

from __future__ import annotations

from collections import deque

import torch

from kvwall.engine.caches.base import DecodeBlocks, KVCache, KVView, attention_specs, valid_tokens
from kvwall.engine.caches.paged_kernel import attend_blocks, in_place_kernel
from kvwall.errors import KvwallError
from kvwall.spec.model import ModelSpec

STACK_KINDS = {torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}  # pool dtypes the fused decode step writes itself


class BlockManager:
    """Free list + per-row block tables."""

    def __init__(self, n_blocks: int, block_size: int, rows: int):
        assert n_blocks > 0 and block_size > 0 and rows > 0, (n_blocks, block_size, rows)
        self.block_size = block_size
        self.free: deque[int] = deque(range(n_blocks))
        self.tables: list[list[int]] = [[] for _ in range(rows)]
        self.lengths = [0] * rows  # tokens held per row

    def grow(self, row: int, length: int) -> None:
        """Row `row` now holds `length` tokens: allocate the blocks that needs."""
        self.grow_all({row: length})

    def grow_all(self, lengths: dict[int, int]) -> None:
        """Rows grow to these lengths, all or none: when the pool cannot give every row its blocks, nothing
        changes (a caller that catches the error keeps a consistent cache, no row reads another's blocks)."""
        need = {}
        for row, length in lengths.items():
            assert length >= self.lengths[row], "a row only grows until it is released"
            need[row] = max(-(-length // self.block_size) - len(self.tables[row]), 0)
        total = sum(need.values())
        if total > len(self.free):
            raise KvwallError(f"the paged cache is out of blocks ({total} more needed, {len(self.free)} free); "
                              "give it more blocks or fewer/shorter sequences")
        for row, length in lengths.items():
            self.tables[row].extend(self.free.popleft() for _ in range(need[row]))
            self.lengths[row] = length

    def release(self, row: int) -> None:
        self.free.extend(self.tables[row])
        self.tables[row] = []
        self.lengths[row] = 0

    def allocated_blocks(self) -> int:
        return sum(len(t) for t in self.tables)

    def used_tokens(self) -> int:
        return sum(self.lengths)

    def check(self) -> None:
        """Invariants: no block both free and allocated, none in two tables, none lost."""
        held = [b for t in self.tables for b in t]
        assert len(held) == len(set(held)), "a block is shared by two rows"
        assert not set(held) & set(self.free), "a block is both free and allocated"
        assert len(held) + len(self.free) == len(set(held) | set(self.free)), "duplicate free block"


class PagedCache(KVCache):
    """nbytes() = predict.memory(spec.with_window(None), batch, context=tokens held, block_size).cache_bytes."""

    name = "paged"
    in_place = True  # decode steps may read the blocks in place (False: always the gather, the reference path)

    def __init__(self, spec: ModelSpec, batch: int, block_size: int = 16, n_blocks: int | None = None,
                 max_len: int = 2048, dtype=torch.float32, device="cpu"):
        n_blocks = n_blocks or batch * -(-max_len // block_size)
        self.blocks = BlockManager(n_blocks, block_size, batch)
        self.block_size = block_size
        self.pools = []
        for a in attention_specs(spec):
            if a is None:
                self.pools.append(None)
                continue
            k = torch.zeros(n_blocks, a.n_kv_heads, block_size, a.head_dim, dtype=dtype, device=device)
            v = torch.zeros(n_blocks, a.n_kv_heads, block_size, a.v_head_dim, dtype=dtype, device=device)
            self.pools.append((k, v))
        self.device = device
        self.table = self.k_pos = self.lengths = None
        self.decoding = False  # this forward: one new token per row, each its row's last (step())

    def step(self, pos):
        """Allocate blocks for the new tokens; rebuild the (B, blocks) table and the slot positions."""
        ends = (pos.max(1).values + 1).tolist()  # (B,) one past each row's last new position
        self.blocks.grow_all({row: max(end, self.blocks.lengths[row]) for row, end in enumerate(ends) if end > 0})
        self.set_table(self.blocks.tables, self.blocks.lengths, pos)

    def set_table(self, tables: list[list[int]], lengths: list[int], pos) -> None:
        """This forward's (B, blocks) table, slot positions and lengths; `decoding` when every row adds one token
        at its end (the in-place kernel's case)."""
        width = max(1, max(len(t) for t in tables))
        table = [t + [0] * (width - len(t)) for t in tables]
        self.table = torch.tensor(table, dtype=torch.long, device=self.device)  # (B, nb)
        slots = torch.arange(width * self.block_size, device=self.device)[None]  # (1, nb * bs)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)  # (B,)
        self.k_pos = torch.where(slots < self.lengths[:, None], slots, -1)  # (B, nb * bs): slot j holds position j
        self.decoding = pos.shape[1] == 1 and pos[:, 0].tolist() == [n - 1 for n in lengths]
        if self.decoding:  # each row's one new token: its block and slot, once per forward rather than per layer
            last = [n - 1 for n in lengths]
            self._new = (torch.tensor([t[p // self.block_size] for t, p in zip(tables, last)], device=self.device),
                         torch.tensor([p % self.block_size for p in last], device=self.device))  # (B,), (B,)

    def write(self, layer, k, v, pos) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the new tokens into their blocks -> the layer's (K, V) pools."""
        kp, vp = self.pools[layer]
        if self.decoding:
            block, slot = self._new
            kp[block, :, slot] = k[:, :, 0]  # (B, Hkv, D)
            vp[block, :, slot] = v[:, :, 0]
            return kp, vp
        b, t, p = valid_tokens(pos)
        block = self.table[b, p // self.block_size]  # (N,) physical blocks
        kp[block, :, p % self.block_size] = k[b, :, t]  # (N, Hkv, D)
        vp[block, :, p % self.block_size] = v[b, :, t]
        return kp, vp

    def update(self, layer, k, v, pos):
        kp, vp = self.write(layer, k, v, pos)
        return self._gather(kp), self._gather(vp), self.k_pos

    def attend(self, layer, q, k, v, pos, scale, window, softcap, sink: int = 0):
        """A decode step under an fp32 query reads the blocks (fp32, bf16, fp16, fp8) in place (paged_kernel.py);
        anything else (prefill, a softcap, sinks, another query dtype, no compiler) gathers them (KVCache.attend)."""
        kernel = None
        if self.in_place and self.decoding:
            kernel = in_place_kernel(q, self.pools[layer][0], softcap, sink, any_float=True)
        if kernel is None:
            return super().attend(layer, q, k, v, pos, scale, window, softcap, sink)
        kp, vp = self.write(layer, k, v, pos)
        return attend_blocks(kernel, q, kp, vp, self.table, self.lengths, window, scale)  # (B, Hq, 1, Dv)

    def decode_blocks(self, batch: int) -> DecodeBlocks | None:
        """The pools as they are, at a decode step that every layer has, when the fused step writes their format
        (stack_views)."""
        if not (self.in_place and self.decoding) or not all(self.pools):
            return None
        views = self.layer_views(self.stack_views)
        return DecodeBlocks(views, self.table, self.lengths) if views else None

    def stack_views(self) -> list[KVView | None]:
        """Each layer's KVView: fp32 or fp8 blocks (the fused step writes fp8 rounded as caches/fp8.py does, the
        rounding ScheduledPages.write uses too); None for any other dtype, which the step does not write."""
        kind = STACK_KINDS.get(self.pools[0][0].dtype)
        return [KVView(kind, k, v) if kind else None for k, v in self.pools]

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        B, nb = self.table.shape
        x = pool[self.table]  # (B, nb, H, bs, D)
        return x.transpose(1, 2).reshape(B, pool.shape[1], nb * self.block_size, pool.shape[3])  # (B, H, S, D)

    def release(self, row: int) -> None:
        self.blocks.release(row)

    def block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V)."""
        return sum(k[0].nbytes + v[0].nbytes for k, v in filter(None, self.pools))

    def nbytes(self) -> int:
        return self.blocks.allocated_blocks() * self.block_bytes()

    def used_bytes(self) -> int:
        return self.blocks.used_tokens() * self.block_bytes() // self.block_size

    def pool_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in filter(None, self.pools))
