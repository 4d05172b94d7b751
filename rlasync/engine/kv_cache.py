"""The KV cache budget: a fixed number of blocks of `block_size` token slots, handed out to requests.

Pure Python (no torch): the scheduler plans with it and the tests check it in microseconds. The tensors the blocks
index live in `rlasync.engine.paged_attention.KVPool`; block `b` owns the pool's slots
`[b * block_size, (b + 1) * block_size)`, so a request's token at position `p` lives in slot
`block_ids[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
"""The built-in engine's KV budget on the CPU when `kv_cache_tokens` is not given."""


def kv_shape(config: PretrainedConfig) -> tuple[int, int, int, int]:
    """(num_layers, num_heads, num_kv_heads, head_dim) of a decoder's (transformers) config."""
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    return int(config.num_hidden_layers), num_heads, num_kv_heads, head_dim


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """KV cache bytes of one token: a key and a value per layer and KV head."""
    return num_layers * 2 * num_kv_heads * head_dim * element_size


def kv_cache_tokens(
    requested: int | None, *, max_model_len: int, max_num_seqs: int, bytes_per_token: int, budget_bytes: int
) -> int:
    """The built-in engine's KV budget in tokens (before rounding up to whole blocks): `requested`
    (`kv_cache_tokens`) when given, else what `budget_bytes` holds (on CUDA: `gpu_memory_utilization` of the
    GPU's memory minus what is in use when the engine builds its pool), never more than every request at full
    length (`max_num_seqs * max_model_len`), never less than one (`max_model_len`)."""
    if requested is None:
        return max(min(budget_bytes // bytes_per_token, max_num_seqs * max_model_len), max_model_len)
    if requested < max_model_len:
        raise ValueError(
            f"kv_cache_tokens={requested} is below max_model_len={max_model_len}: a request of max_model_len "
            "tokens could never run"
        )
    return requested


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` token slots."""
    return -(-num_tokens // block_size)


BlockKey = tuple[int, tuple[int, ...]]  # (hash of the previous block's key, this block's tokens)


def prompt_block_keys(prompt_ids: list[int], block_size: int) -> list[BlockKey]:
    """Chained keys of the prompt's full blocks: block j's key names all tokens up to its end (its parent's key hash
    and its own tokens), so equal keys mean equal prefixes (up to a 64-bit hash collision of a parent)."""
    keys: list[BlockKey] = []
    parent = 0
    for begin in range(0, len(prompt_ids) - block_size + 1, block_size):
        key = (parent, tuple(prompt_ids[begin : begin + block_size]))
        keys.append(key)
        parent = hash(key)
    return keys


class BlockAllocator:
    """Reference-counted block ids (0 .. num_blocks - 1), with an optional prefix cache of full prompt blocks.

    Blocks freed last are handed out first (warm in cache). `allocate` is all-or-nothing and raises when the blocks
    are not there: callers check `num_free` first (the scheduler preempts instead).

    Prefix cache (`enable_caching`): a block whose KV holds a full block of some prompt is registered under its
    `BlockKey` (`cache`). A later request with the same prompt prefix takes it (`lookup` + `acquire`) instead of
    recomputing it; a block shared by several requests is freed when the last one lets go. Unreferenced cached
    blocks stay reusable ("evictable", oldest first) until a fresh allocation needs them. `clear_cache` forgets every
    key (the weights changed: the cached KV is stale).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, still cached; oldest first
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free ones and unreferenced cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage_frac(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError(f"KV cache: asked for {count} blocks but only {self.num_free} are free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently released cached block
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._refs[block] <= 0:
                raise RuntimeError(f"KV cache: block {block} freed twice")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ---- prefix cache -------------------------------------------------------------------------------------------

    def lookup(self, key: BlockKey) -> int | None:
        return self._block_of.get(key) if self.enable_caching else None

    def acquire(self, block: int) -> None:
        """Take one more reference to a cached block (found by `lookup`)."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def cache(self, block: int, key: BlockKey) -> None:
        """Register a referenced block as holding the prefix `key` (first come: a key already cached keeps its
        block, a block keeps its first key)."""
        if not self.enable_caching or key in self._block_of or block in self._key_of:
            return
        self._key_of[block] = key
        self._block_of[key] = block

    def clear_cache(self) -> None:
        """Forget every cached prefix; unreferenced cached blocks become plain free blocks."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
