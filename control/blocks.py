"""The KV block pool of one lane: lane-local block ids, reference counts, exact accounting,
the block tables of its requests in every KV group, and the prefix cache over them.

The pool is the only writer of a request's block tables (`Request.block_tables`,
`num_skipped_blocks`, and `num_published_blocks`, how many blocks the prefix cache holds):
`assign`, `grow`, `advance`, `release`.

KV groups (vLLM's hybrid KV cache manager): a hybrid-attention model's layers form groups of
equal size, each with its own block table per request, all drawn from this one pool (a block
is one group's at a time). Group 0 is full attention and keeps every block; a sliding-window
group's request gives back the blocks its window no longer reads (`advance`): the first
max(0, n - W + 1) // block_size blocks once n tokens are computed, since the next position, n,
reads n - W + 1 onwards. Every group's table has the same number of entries (skipped + live):
the request's logical blocks. A model of one group is the plain case: one table, nothing skipped.

Invariants (checked by `check`):
- a block is in the free list iff its reference count is 0; free + used = total;
- a cached block (one with a group and hash) is either in use, or free and reusable by a later
  hit until allocation evicts it. Free blocks are reused least-recently-freed first, so a
  request's tail blocks, freed first (see `free`), go before its shared prefix.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .request import Request


@dataclass(slots=True)
class PrefixHit:
    """The cached prefix a request can start from: KV of its first num_blocks * block_size
    tokens, as each group holds it (a sliding group: only the blocks its window reads at the
    resume point, after `skipped` it needs no longer)."""
    num_blocks: int
    tables: list[list[int]]
    skipped: list[int]

    @property
    def block_ids(self) -> list[int]:
        """Every group's blocks of the hit."""
        return [b for table in self.tables for b in table]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 windows: tuple[int, ...] = (0,)) -> None:
        """`windows`: per KV group, the sliding window in tokens (0: full attention); group 0 is
        full attention."""
        assert num_blocks > 0 and block_size > 0
        assert windows and windows[0] == 0 and all(w >= 0 for w in windows), windows
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = windows
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        # A cached block is keyed by its group and the hash of its full content: the groups
        # hold KV of the same tokens in different layers.
        self._hash_of: dict[int, tuple[int, int]] = {}    # block id -> (group, hash)
        self._block_of: dict[tuple[int, int], int] = {}   # (group, hash) -> block id
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

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def can_grow(self, num_blocks: int) -> bool:
        """`num_blocks` more logical blocks for one request fit: that many in every group."""
        return num_blocks * len(self.windows) <= len(self._free)

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
    def assign(self, request: Request, hit: PrefixHit) -> None:
        """A request starts on this lane with its prefix-cache hit as its first blocks."""
        assert not request.block_tables
        self.take(hit.block_ids)
        request.block_tables = [list(t) for t in hit.tables]
        request.num_skipped_blocks = list(hit.skipped)
        request.num_published_blocks = hit.num_blocks

    def grow(self, request: Request, num_blocks: int) -> list[list[int]]:
        """Append `num_blocks` new blocks to its table in every group; returns their ids by group."""
        new_ids = self.allocate(num_blocks * len(self.windows))
        by_group = [new_ids[g * num_blocks:(g + 1) * num_blocks] for g in range(len(self.windows))]
        for table, ids in zip(request.block_tables, by_group):
            table += ids
        return by_group

    def advance(self, request: Request) -> None:
        """Its computed tokens grew: its blocks that just became full join the prefix cache, and
        each sliding group gives back the blocks its window no longer reads."""
        self._publish(request)
        computed = request.num_computed_tokens
        for g, window in enumerate(self.windows):
            if not window:
                continue
            skip = max(0, computed - window + 1) // self.block_size  # position `computed` reads on
            gone = skip - request.num_skipped_blocks[g]
            if gone > 0:
                table = request.block_tables[g]
                self.free(reversed(table[:gone]))
                del table[:gone]
                request.num_skipped_blocks[g] = skip

    def _publish(self, request: Request) -> None:
        full = request.num_computed_tokens // self.block_size
        if self.enable_caching and full > request.num_published_blocks:
            hashes = request.full_block_hashes(self.block_size, request.num_computed_tokens)
            for g, (table, skipped) in enumerate(zip(request.block_tables, request.num_skipped_blocks)):
                for i in range(max(request.num_published_blocks, skipped), full):
                    self.cache(table[i - skipped], g, hashes[i])
            request.num_published_blocks = full

    def release(self, request: Request) -> None:
        """Give its blocks back, tail first across its groups (see `free`): logical block i of
        every group before block i - 1 of any, so the prefix a later hit needs in group 0 goes last."""
        tables, skipped = request.block_tables, request.num_skipped_blocks
        logical = len(tables[0]) if tables else 0
        self.free(table[i - skip] for i in reversed(range(logical))
                  for table, skip in zip(tables, skipped) if i >= skip)
        request.block_tables = []
        request.num_skipped_blocks = []
        request.num_published_blocks = 0

    # ---- prefix cache --------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> PrefixHit:
        """The longest cached prefix of `hashes` that every group holds (does not take it): group
        0 every block of it, a sliding group the blocks its window reads at the resume point."""
        if not self.enable_caching:
            return PrefixHit(0, [[] for _ in self.windows], [0] * len(self.windows))
        first = self._cached(0, hashes)
        # Per later group, how many cached blocks end at each index (consecutive): a prefix of n
        # blocks fits the group when its window's blocks, [skip(n), n), are all cached.
        runs = []
        for g in range(1, len(self.windows)):
            run, count = [], 0
            for h in hashes[:len(first)]:
                count = count + 1 if (g, h) in self._block_of else 0
                run.append(count)
            runs.append(run)
        for n in range(len(first), -1, -1):  # one pass for a model of one group
            skipped = [self._skipped(w, n) for w in self.windows]
            if all(n == skip or run[n - 1] >= n - skip for run, skip in zip(runs, skipped[1:])):
                tables = [first[:n], *([self._block_of[(g, h)] for h in hashes[skipped[g]:n]]
                                       for g in range(1, len(self.windows)))]
                return PrefixHit(n, tables, skipped)
        raise AssertionError("the empty prefix is always a hit")

    def _skipped(self, window: int, num_blocks: int) -> int:
        """Leading blocks a group of `window` no longer reads at the resume point of a
        num_blocks-block prefix (the next position, num_blocks * block_size, reads W - 1 back)."""
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size if window else 0

    def _cached(self, group: int, hashes: list[int]) -> list[int]:
        """The cached blocks of `group` for the longest prefix of `hashes` it holds."""
        ids = []
        for h in hashes:
            block_id = self._block_of.get((group, h))
            if block_id is None:
                break
            ids.append(block_id)
        return ids

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

    def cache(self, block_id: int, group: int, block_hash: int) -> None:
        """Publish a full, computed block of `group` under its hash. The first block with a given
        content stays the cached one; a later duplicate simply is not shared."""
        key = (group, block_hash)
        if self.enable_caching and key not in self._block_of:
            self._block_of[key] = block_id
            self._hash_of[block_id] = key

    def _evict(self, block_id: int) -> None:
        key = self._hash_of.pop(block_id, None)
        if key is not None:
            del self._block_of[key]

    def check(self) -> None:
        in_use = sum(1 for count in self._ref_counts if count > 0)
        assert in_use + len(self._free) == self.num_blocks
        assert all(self._ref_counts[b] == 0 for b in self._free)
        assert len(self._hash_of) == len(self._block_of)
        assert all(self._block_of[h] == b for b, h in self._hash_of.items())
