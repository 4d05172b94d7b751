"""The KV cache budget: a fixed number of blocks of `block_size` token slots, handed out to requests.

Pure Python (no torch): the scheduler plans with it and the tests check it in microseconds. The tensors the blocks
index live in `rlasync.engine.paged_attention.KVPool`; block `b` owns the pool's slots
`[b * block_size, (b + 1) * block_size)`, so a request's token at position `p` lives in slot
`block_ids[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` token slots."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """A free list of `num_blocks` block ids (0 .. num_blocks - 1).

    Blocks freed last are handed out first (warm in cache). `allocate` is all-or-nothing and raises when the blocks
    are not there: callers check `num_free` first (the scheduler preempts instead).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage_frac(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"KV cache: asked for {count} blocks but only {len(self._free)} are free")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._is_free[block] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._is_free[block]:
                raise RuntimeError(f"KV cache: block {block} freed twice")
            self._is_free[block] = True
            self._free.append(block)
