"""BlockPool: the physical KV blocks, their reference counts, the LRU free queue and the key -> block map.

The pool knows nothing about requests; `KVCacheManager` decides which blocks a request holds. Eviction is
lazy: a block whose count drops to 0 keeps its key and stays findable, and only loses the key when the
free queue hands it out again. That is what lets a finished request's prompt be hit by the next one.

For the cache report and the KV map it also keeps, per block, its key's parent and how many prefix hits
reused it since it was cached, and a bounded record of recently evicted keys (so a miss can say `evicted`
rather than `new`): plain list writes on paths that already touch the block.

State is plain Python lists and dicts indexed by block id; every operation costs O(blocks touched).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedkv.kv.hashing import BlockKey

if TYPE_CHECKING:
    from pagedkv.kv.events import KVEventRecorder


class BlockPool:
    """`num_blocks` blocks, all free at start; the free queue hands out the least recently freed first."""

    def __init__(self, num_blocks: int, evicted_record_size: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt: list[int] = [0] * num_blocks
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._parent_key: list[BlockKey | None] = [None] * num_blocks
        self._hits: list[int] = [0] * num_blocks  # prefix hits on the block since it was cached
        # Keys evicted lately, oldest first; twice the pool by default: a few pool-fulls of turnover.
        self._evicted: OrderedDict[BlockKey, None] = OrderedDict()
        self.evicted_record_size = max(1024, 2 * num_blocks) if evicted_record_size is None else evicted_record_size
        self._key_to_block: dict[BlockKey, int] = {}
        # OrderedDict as the LRU queue: popitem(last=False) takes the oldest, `del` removes a hit in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0
        self.events: KVEventRecorder | None = None  # records evictions and resets, for KV events

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

    def parent_key_of(self, block_id: int) -> BlockKey | None:
        """The key of the block before this one in its prompt (None for a first block or an unkeyed one)."""
        return self._parent_key[block_id]

    def hits(self) -> list[int]:
        """Per block, how many prefix hits reused it since it was cached (a copy)."""
        return list(self._hits)

    def record_hits(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._hits[block_id] += 1

    def was_evicted(self, key: BlockKey) -> bool:
        """Whether `key` was cached and has been evicted lately (within the bounded record)."""
        return key in self._evicted

    def take_new(self, count: int) -> list[int]:
        """Hand out `count` blocks from the head of the free queue with ref count 1, evicting their keys.

        The caller checks `num_free_blocks` first; asking for more is a bug, not a recoverable condition.
        """
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with only {len(self._free)} free")
        taken: list[int] = []
        evicted: list[BlockKey] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            key = self._block_key[block_id]
            if key is not None:
                del self._key_to_block[key]
                self._block_key[block_id] = None
                self._parent_key[block_id] = None
                self._hits[block_id] = 0
                self._remember_eviction(key)
                self.num_evictions += 1
                evicted.append(key)
            self._ref_cnt[block_id] = 1
            taken.append(block_id)
        if self.events is not None:
            self.events.removed(evicted)
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

    def _remember_eviction(self, key: BlockKey) -> None:
        if self.evicted_record_size <= 0:
            return
        self._evicted[key] = None
        if len(self._evicted) > self.evicted_record_size:
            self._evicted.popitem(last=False)

    def cache(self, block_id: int, key: BlockKey, parent: BlockKey | None = None) -> bool:
        """Register `block_id` under `key` (`parent`: the previous block's key, for the prefix tree); False
        (and nothing changes) if another block already holds `key`.

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
        self._parent_key[block_id] = parent
        self._evicted.pop(key, None)  # cached again: a later miss on it is not "evicted" until it is
        return True

    def reset(self) -> bool:
        """Forget every key and the eviction record; refused (False) while any block is held, since its owner
        may still rely on it."""
        if len(self._free) != self.num_blocks:
            return False
        self._key_to_block.clear()
        self._block_key = [None] * self.num_blocks
        self._parent_key = [None] * self.num_blocks
        self._hits = [0] * self.num_blocks
        self._evicted.clear()  # a reset starts over: what follows is "new", as in a fresh engine
        if self.events is not None:
            self.events.cleared()
        return True
