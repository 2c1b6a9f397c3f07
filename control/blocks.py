"""The KV block pool of one lane: lane-local block ids, reference counts, exact accounting,
and the prefix cache over it.

The pool is the only writer of a request's block table (`Request.block_ids`, and
`num_published_blocks`, how many of them the prefix cache holds): `assign`, `grow`, `publish`,
`release`.

Invariants (checked by `check`):
- a block is in the free list iff its reference count is 0; free + used = total;
- a cached block (one with a hash) is either in use, or free and reusable by a later hit until
  allocation evicts it. Free blocks are reused least-recently-freed first, so a request's tail
  blocks, freed first (see `free`), go before its shared prefix.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .request import Request


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, int] = {}    # block id -> hash of its full content
        self._block_of: dict[int, int] = {}   # hash -> block id
        self.num_queries = 0                  # prefix-cache lookups, in blocks
        self.num_hits = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise MemoryError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; pass a request's blocks tail first so its unique
        suffix is reused before its (possibly shared) prefix."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    # ---- block tables --------------------------------------------------------------------
    def assign(self, request: Request, hits: list[int]) -> None:
        """A request starts on this lane with its prefix-cache hits as its first blocks."""
        assert not request.block_ids
        self.take(hits)
        request.block_ids = list(hits)
        request.num_published_blocks = len(hits)

    def grow(self, request: Request, num_blocks: int) -> list[int]:
        """Append `num_blocks` new blocks to its table; returns their ids."""
        new_ids = self.allocate(num_blocks)
        request.block_ids += new_ids
        return new_ids

    def publish(self, request: Request) -> None:
        """Its blocks that just became full and computed join the prefix cache."""
        full = request.num_computed_tokens // self.block_size
        if self.enable_caching and full > request.num_published_blocks:
            hashes = request.full_block_hashes(self.block_size, request.num_computed_tokens)
            for i in range(request.num_published_blocks, full):
                self.cache(request.block_ids[i], hashes[i])
            request.num_published_blocks = full

    def release(self, request: Request) -> None:
        """Give its blocks back, tail first (see `free`)."""
        self.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_published_blocks = 0

    # ---- prefix cache --------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (does not take them)."""
        hits = []
        if self.enable_caching:
            for h in hashes:
                block_id = self._block_of.get(h)
                if block_id is None:
                    break
                hits.append(block_id)
        return hits

    def num_free_among(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    def take(self, block_ids: list[int]) -> None:
        """Add a reference to each cached block of a hit (leaving the free list if idle)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def record_query(self, num_blocks: int, num_hits: int) -> None:
        self.num_queries += num_blocks
        self.num_hits += num_hits

    def cache(self, block_id: int, block_hash: int) -> None:
        """Publish a full, computed block under its hash. The first block with a given content
        stays the cached one; a later duplicate simply is not shared."""
        if self.enable_caching and block_hash not in self._block_of:
            self._block_of[block_hash] = block_id
            self._hash_of[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]

    def check(self) -> None:
        in_use = sum(1 for count in self._ref_counts if count > 0)
        assert in_use + len(self._free) == self.num_blocks
        assert all(self._ref_counts[b] == 0 for b in self._free)
        assert len(self._hash_of) == len(self._block_of)
        assert all(self._block_of[h] == b for b, h in self._hash_of.items())
