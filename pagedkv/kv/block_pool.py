"""BlockPool: the physical KV blocks, their reference counts, the LRU free queue and the key -> block map.

The pool knows nothing about requests; `KVCacheManager` decides which blocks a request holds. Eviction is
lazy: a block whose count drops to 0 keeps its key and stays findable, and only loses the key when the
free queue hands it out again. That is what lets a finished request's prompt be hit by the next one.

State is plain Python lists and dicts indexed by block id; every operation costs O(blocks touched).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedkv.kv.hashing import BlockKey


class BlockPool:
    """`num_blocks` blocks, all free at start; the free queue hands out the least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt: list[int] = [0] * num_blocks
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._key_to_block: dict[BlockKey, int] = {}
        # OrderedDict as the LRU queue: popitem(last=False) takes the oldest, `del` removes a hit in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached or not: all of them can be handed out."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def ref_counts(self) -> list[int]:
        return list(self._ref_cnt)

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._block_key[block_id]

    def lookup(self, key: BlockKey) -> int | None:
        """The block cached under `key` (held or free), or None."""
        return self._key_to_block.get(key)

    def free_order(self) -> list[int]:
        """Free block ids, next to be handed out first (for tests and debugging; O(num_blocks))."""
        return list(self._free)

    def num_cached_blocks(self) -> int:
        return len(self._key_to_block)

    def take_new(self, count: int) -> list[int]:
        """Hand out `count` blocks from the head of the free queue with ref count 1, evicting their keys.

        The caller checks `num_free_blocks` first; asking for more is a bug, not a recoverable condition.
        """
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with only {len(self._free)} free")
        taken: list[int] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            key = self._block_key[block_id]
            if key is not None:
                del self._key_to_block[key]
                self._block_key[block_id] = None
                self.num_evictions += 1
            self._ref_cnt[block_id] = 1
            taken.append(block_id)
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a free one leaves the free queue (a hit revives it)."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; blocks reaching 0 join the queue's tail.

        The order given is the eviction order among these blocks: the first one to reach 0 goes first.
        """
        for block_id in block_ids:
            ref = self._ref_cnt[block_id]
            if ref == 0:
                raise RuntimeError(f"block {block_id} released more times than it was taken")
            self._ref_cnt[block_id] = ref - 1
            if ref == 1:
                self._free[block_id] = None

    def cache(self, block_id: int, key: BlockKey) -> bool:
        """Register `block_id` under `key`; False (and nothing changes) if another block already holds `key`.

        Keeping the first mapping is safe: two blocks with one key hold the same K/V, and the one left
        unkeyed simply stays private to its request until it is freed and reused.
        """
        existing = self._key_to_block.get(key)
        if existing is not None:
            return existing == block_id
        if self._block_key[block_id] is not None:
            raise RuntimeError(f"block {block_id} already has a different key")
        self._key_to_block[key] = block_id
        self._block_key[block_id] = key
        return True

    def reset(self) -> bool:
        """Forget every key; refused (False) while any block is held, since its owner may still rely on it."""
        if len(self._free) != self.num_blocks:
            return False
        self._key_to_block.clear()
        self._block_key = [None] * self.num_blocks
        return True
