"""The KV block pool of one lane: lane-local block ids with exact accounting.

Reference counts are kept per block so that shared (prefix-cached, parallel-sampled) blocks slot
in later; today every allocated block has exactly one owner.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

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
        ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in ids:
            assert self._ref_counts[block_id] == 0
            self._ref_counts[block_id] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check(self) -> None:
        """Exact accounting: a block is free iff nobody references it."""
        in_use = sum(1 for count in self._ref_counts if count > 0)
        assert in_use + len(self._free) == self.num_blocks
        assert len(set(self._free)) == len(self._free)
