"""The paged pool's blocks by count: free list, reference counts and the prefix cache (torch-free).

A block holds `block_size` consecutive tokens of one sequence. Blocks are shared by reference count:
a full block whose K/V have been computed is *sealed* with a hash of its tokens and of the hash of
the block before it (so equal hashes mean an equal whole prefix, not just equal block contents).
A later request whose prompt starts with the same full blocks takes them by reference instead of
recomputing them (prefix caching). A sealed block is never written again: a request about to write
into one (its whole prompt was cached, and its last token is recomputed for a logit) gets a private
copy first (copy-on-write; the caller copies the K/V).

A block whose last holder lets go returns to the free list but keeps its hash: until it is handed
out again (oldest freed first), a request with the same prefix can still revive it.

Blocks come into being when first handed out (never-used ones first, in id order, then the freed ones):
the manager's memory grows with the blocks requests used, not with the pool's size (the simulator's
`--kv-memory 1000TB` built one Block object per block up front until it ran out of memory).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    id: int
    ref: int = 0  # holders (requests whose block table lists it)
    hash: int | None = None  # set once the block is full and computed (sealed)
    tokens: tuple[int, ...] = ()  # the sealed block's tokens: a hash collision never shares wrong K/V


def block_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    """The hash of a full block: its tokens and everything before it (through the previous block's hash).
    Python hashes ints and tuples of ints the same in every process."""
    return hash((prev, tokens))


class BlockManager:
    """n_blocks blocks of block_size tokens; requests hold lists of block ids (their block tables)."""

    def __init__(self, n_blocks: int, block_size: int):
        assert n_blocks > 0 and block_size > 0, (n_blocks, block_size)
        self.block_size, self.n_blocks = block_size, n_blocks
        self.blocks: dict[int, Block] = {}  # the blocks handed out so far; ids [0, unused_from)
        self.unused_from = 0  # blocks [unused_from, n_blocks) were never handed out: free, no hash
        # freed blocks, oldest freed first; an OrderedDict, whose first key is O(1): a dict's scans past the slots
        # its deletes left, 25 us a block in a 10,000-request simulation (a third of its time)
        self.free: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}  # sealed hash -> block id
        self.hits = 0  # blocks taken from the prefix cache instead of computed

    def n_free(self) -> int:
        return self.n_blocks - self.unused_from + len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self) -> int:
        """A fresh block (ref 1): a never-used one while any is left, else the oldest freed one; it stops being
        findable by its old hash."""
        if self.unused_from < self.n_blocks:
            bid, self.unused_from = self.unused_from, self.unused_from + 1
            self.blocks[bid] = Block(bid, ref=1)
            return bid
        assert self.free, "allocate() with no free block: check n_free() first"
        bid, _ = self.free.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None and self.cached.get(b.hash) == bid:
            del self.cached[b.hash]
        b.ref, b.hash, b.tokens = 1, None, ()
        return bid

    def take(self, bid: int) -> None:
        """One more holder of a (sealed) block, reviving it from the free list when nobody held it."""
        b = self.blocks[bid]
        if b.ref == 0:
            del self.free[bid]
        b.ref += 1

    def release(self, table: list[int]) -> None:
        """A request lets go of its blocks; the last blocks are freed first, so they are reused first and the
        prefix (the blocks most likely to be shared) stays cached longest."""
        for bid in reversed(table):
            b = self.blocks[bid]
            assert b.ref > 0, f"block {bid} released more often than taken"
            b.ref -= 1
            if b.ref == 0:
                self.free[bid] = None

    def cached_prefix(self, tokens: list[int]) -> list[int]:
        """The sealed blocks holding the longest run of full blocks that `tokens` starts with."""
        found, prev, bs = [], None, self.block_size
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            prev = block_hash(prev, chunk)
            bid = self.cached.get(prev)
            if bid is None or self.blocks[bid].tokens != chunk:
                break
            found.append(bid)
        return found

    def revive_cost(self, bids: list[int]) -> int:
        """Free blocks that taking `bids` uses up (those nobody holds now)."""
        return sum(1 for bid in bids if self.blocks[bid].ref == 0)

    def seal(self, bid: int, prev: int | None, tokens: tuple[int, ...]) -> int:
        """Block `bid` is full and computed: make it findable by the hash of its prefix; return that hash."""
        assert len(tokens) == self.block_size, (len(tokens), self.block_size)
        h = block_hash(prev, tokens)
        b = self.blocks[bid]
        b.hash, b.tokens = h, tokens
        self.cached.setdefault(h, bid)  # a twin computed by another request at the same time stays private
        return h

    def sealed(self, bid: int) -> bool:
        return self.blocks[bid].hash is not None

    def copy_on_write(self, bid: int) -> int:
        """A private, writable copy of a sealed block for a request about to write into it (the caller copies
        the K/V): sealed blocks are never written, since other requests may read them in the same step."""
        assert self.sealed(bid), "only a sealed block is copied"
        new = self.allocate()
        self.release([bid])
        return new

    def check(self, tables: list[list[int]]) -> None:
        """Conservation: every block is free (held by nobody) or held exactly by the tables listing it; none lost,
        none free twice, no cached hash pointing at a block that no longer holds it."""
        held: dict[int, int] = {}
        for table in tables:
            assert len(table) == len(set(table)), "a request holds a block twice"
            for bid in table:
                assert bid in self.blocks, f"block {bid} is held but was never handed out"
                held[bid] = held.get(bid, 0) + 1
        assert sorted(self.blocks) == list(range(self.unused_from)), "the handed-out blocks are not [0, unused_from)"
        for b in self.blocks.values():
            n = held.get(b.id, 0)
            assert b.ref == n, f"block {b.id}: ref {b.ref}, held by {n} tables"
            assert (b.ref == 0) == (b.id in self.free), f"block {b.id}: ref {b.ref}, free {b.id in self.free}"
        assert self.n_free() + sum(1 for b in self.blocks.values() if b.ref) == self.n_blocks, "a block is lost"
        for h, bid in self.cached.items():
            assert self.blocks[bid].hash == h, f"cached hash points at block {bid}, which no longer holds it"
