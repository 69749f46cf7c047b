"""WindowGroup: the KV blocks of a model's sliding-window layers, which keep only each request's last window.

A query at position p of a windowed layer reads keys (p - window, p] only, so once a request has computed
position s, every block wholly before ``s - window + 1`` is dead for its windowed layers: this group releases
it (it stays cached under its key until evicted) and the request's table entry for it points at the null
block instead. The null block is one block past the group's ``num_blocks`` in the windowed layers' pool
tensors: zeros, never handed out, never written; readers skip it (the kernel) or mask it out (the torch
backend). So a long request holds at most ``ceil(window / block_size) + 1`` windowed blocks between steps.

The group has its own :class:`BlockPool` -- its own block ids, LRU queue and key map -- and uses the same
block keys as the full-attention layers (a key names a prompt prefix, whatever layers hold its K/V).
``HybridKVCacheManager`` (``pagedkv.kv.hybrid``) drives it beside the full-attention group. The rules --
which blocks a prefix hit needs here, the eviction order, the memory bound -- are in docs/sliding-window.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import BlockKey


@dataclass(slots=True)
class WindowHit:
    """The windowed layers' part of a prefix hit of ``num_blocks`` blocks: the blocks its window needs,
    ``block_ids`` for table entries ``[first_block, num_blocks)``; the entries before are the null block."""

    num_blocks: int
    first_block: int
    block_ids: list[int]


class WindowGroup:
    """Per request, a block table over its whole context whose slid-out entries are the null block."""

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        if window < 1:
            raise ValueError(f"a window group needs a window of >= 1 token, got {window}")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks)
        self.null_block = num_blocks  # the pool tensors' extra block: never handed out (see the module doc)
        self._tables: dict[str, list[int]] = {}
        self._num_released: dict[str, int] = {}  # leading table entries that are the null block
        self._num_keyed: dict[str, int] = {}  # leading entries registered in the cache (or released)

    @property
    def num_pool_blocks(self) -> int:
        """Blocks the windowed layers' pool tensors hold: the group's, and the null block."""
        return self.pool.num_blocks + 1

    def first_needed_block(self, position: int) -> int:
        """The first block a query at ``position`` reads: the one holding key ``position - window + 1``."""
        return max(0, position - self.window + 1) // self.block_size

    def longest_hit(self, block_keys: Sequence[BlockKey], num_blocks: int, from_start: bool) -> WindowHit:
        """The longest hit of ``k <= num_blocks`` leading blocks whose window this group still holds.

        Computing resumes at position ``k * block_size``, whose window needs the cached blocks
        ``[first_needed_block(k * block_size), k)`` -- or ``[0, k)`` with ``from_start`` (a prompt that is
        scored recomputes every position over the hit). Changes nothing.
        """
        found = [self.pool.lookup(key) for key in block_keys[:num_blocks]]
        run_ending_at: list[int] = []  # cached blocks in a row ending at each index
        run = 0
        for block_id in found:
            run = run + 1 if block_id is not None else 0
            run_ending_at.append(run)
        for k in range(num_blocks, 0, -1):
            first = 0 if from_start else self.first_needed_block(k * self.block_size)
            if run_ending_at[k - 1] >= k - first:
                return WindowHit(k, first, [b for b in found[first:k] if b is not None])
        return WindowHit(0, 0, [])

    def check_hit(self, block_keys: Sequence[BlockKey], hit: WindowHit) -> None:
        """Raise if the hit went stale (a block evicted and reused since the lookup)."""
        keys = [self.pool.key_of(b) for b in hit.block_ids]
        if keys != list(block_keys[hit.first_block : hit.num_blocks]):
            raise ValueError("stale PrefixHit: call find_cached_prefix() again right before allocate()")

    def num_blocks_needed(self, request_id: str, num_tokens: int, hit: WindowHit | None) -> int:
        """Blocks ``allocate`` would take out of the free queue: new ones plus free cached ones it revives."""
        table = self._tables.get(request_id, ())
        have = len(table) if hit is None else hit.num_blocks
        revived = 0 if hit is None else sum(1 for b in hit.block_ids if self.pool.ref_count(b) == 0)
        return max(0, -(-num_tokens // self.block_size) - have) + revived

    def allocate(self, request_id: str, num_tokens: int, hit: WindowHit | None) -> None:
        """Cover positions [0, num_tokens); the caller checked ``num_blocks_needed`` against the free blocks."""
        table = self._tables.setdefault(request_id, [])
        if hit is not None:
            self.pool.touch(hit.block_ids)
            table.extend([self.null_block] * hit.first_block + hit.block_ids)
            self._num_released[request_id] = hit.first_block
            self._num_keyed[request_id] = hit.num_blocks
        else:
            self._num_released.setdefault(request_id, 0)
            self._num_keyed.setdefault(request_id, 0)
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new > 0:
            table.extend(self.pool.take_new(num_new))

    def release_slid_out(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks no query from ``num_computed_tokens`` on reads, oldest first (so they are
        evicted first), and point their entries at the null block. Call it after caching them."""
        table = self._tables.get(request_id)
        if not table:
            return
        start = self._num_released[request_id]
        end = min(self.first_needed_block(num_computed_tokens), len(table))
        if end > start:
            self.pool.release(table[start:end])
            table[start:end] = [self.null_block] * (end - start)
            self._num_released[request_id] = end

    def cache_full_blocks(self, request_id: str, block_keys: Sequence[BlockKey], num_full_blocks: int) -> None:
        """Register the keys of the request's held blocks among [0, num_full_blocks) not registered yet; as
        ``KVCacheManager.cache_full_blocks`` (an existing mapping of a key stays)."""
        table = self._tables.get(request_id)
        if table is None:
            return
        start = max(self._num_keyed[request_id], self._num_released[request_id])
        for i in range(start, min(num_full_blocks, len(table), len(block_keys))):
            if self.pool.lookup(block_keys[i]) is None:
                self.pool.cache(table[i], block_keys[i], block_keys[i - 1] if i else None)
        self._num_keyed[request_id] = max(self._num_keyed[request_id], num_full_blocks)

    def free(self, request_id: str) -> None:
        """Release the request's held blocks, last first, as the full-attention group does."""
        table = self._tables.pop(request_id, None)
        start = self._num_released.pop(request_id, 0)
        self._num_keyed.pop(request_id, None)
        if table:
            self.pool.release(reversed(table[start:]))

    def block_table(self, request_id: str) -> list[int]:
        """The request's table, the null block for released entries (the live list: read, don't mutate)."""
        return self._tables.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in this group (its table less the null entries)."""
        return len(self._tables.get(request_id, ())) - self._num_released.get(request_id, 0)
