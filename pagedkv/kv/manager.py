"""KVCacheManager: per-request block tables on top of the BlockPool, with automatic prefix caching.

The scheduler's view of the KV cache: look up how much of a prompt is already cached, give a request the
blocks for its next tokens (all or nothing), and free a request's blocks when it finishes or is preempted.
Caching is the manager's own business: whenever a request allocates or frees, its blocks that are full of
computed tokens are registered under their keys first -- computed means verified, so a block holding a
speculative draft's K/V is never cached. Block keys come from the request (`pagedkv.kv.hashing`); this
class never hashes tokens itself, so each block is keyed once and the keys are reused every step.

With a disk tier (``LLM(kv_cache_dir=...)``, ``pagedkv.kv.disk_tier``), every block the manager caches is
also queued for disk, and ``load_from_disk`` brings a prompt's leading blocks found there into the pool as
cached free blocks -- from then on they are ordinary memory hits for the lookup, the counters and the cache
report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import TYPE_CHECKING

from pagedkv.kv import cache_report
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import BlockKey
from pagedkv.kv.window_group import WindowHit

if TYPE_CHECKING:
    from pagedkv.kv.disk_tier import DiskTier
    from pagedkv.kv.events import KVEventRecorder


@dataclass(slots=True)
class PrefixHit:
    """Result of a prefix lookup, to be passed to `allocate` in the same scheduling step.

    `block_keys` are the keys the blocks were found under; `allocate` checks them so a hit that went
    stale (its block evicted and reused in between) fails loudly instead of serving someone else's K/V.
    With sliding-window layers (``pagedkv.kv.hybrid``): their blocks, and whether their evictions cut it short.
    """

    block_ids: list[int]
    num_tokens: int
    num_queried_tokens: int
    block_keys: list[BlockKey]
    window: WindowHit | None = None
    window_cut: bool = False


class KVCacheManager:
    """Block tables for requests; free blocks include cached ones nobody holds (evictable any time)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, disk: DiskTier | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # How many leading blocks of each request are already registered (or found) in the cache.
        self._num_keyed: dict[str, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.disk = disk  # the disk tier, with kv_cache_dir
        self.events: KVEventRecorder | None = None  # set by the engine while KV events are published

    def record_events(self, recorder: KVEventRecorder | None) -> None:
        """Record blocks stored, evicted and cleared into ``recorder`` (None: stop recording)."""
        self.events = self.pool.events = recorder

    def _stored(self, block_keys: Sequence[BlockKey], indices: list[int], token_ids: Sequence[int]) -> None:
        """One BlockStored event per run of consecutive newly cached blocks (``indices``, ascending)."""
        if self.events is None:
            return
        size = self.block_size
        first = 0
        for j in range(1, len(indices) + 1):
            if j == len(indices) or indices[j] != indices[j - 1] + 1:
                a, b = indices[first], indices[j - 1] + 1
                self.events.stored(block_keys[a:b], block_keys[a - 1] if a else None, token_ids[a * size : b * size])
                first = j

    def load_from_disk(
        self, block_keys: Sequence[BlockKey], num_prompt_tokens: int, token_ids: Sequence[int] = ()
    ) -> int:
        """Bring the prompt's leading blocks that are on disk but not in the pool into the pool; how many.

        Walks the blocks ``find_cached_prefix`` may reuse, in order, through those in memory, until one is in
        neither tier. Those on disk are read into free blocks and cached there, free (ref count 0) at the
        tail of the free queue, tail first like a finished request's; the walk's memory blocks are held
        meanwhile, so taking blocks for the loads never evicts them. Stops at the first load that fails, and
        where free blocks run out: a later block is no use without the ones before it.
        """
        disk = self.disk
        if disk is None or not self.enable_prefix_caching:
            return 0
        chain: list[int | None] = []  # per leading block: its block id if in memory, None if on disk
        for key in block_keys[: max(num_prompt_tokens - 1, 0) // self.block_size]:
            block_id = self.pool.lookup(key)
            if block_id is None and not disk.contains(key):
                break
            chain.append(block_id)
        if None not in chain:
            return 0
        held = [b for b in chain if b is not None]
        self.pool.touch(held)
        missing = [i for i, b in enumerate(chain) if b is None]
        count = min(len(missing), self.pool.num_free_blocks)
        fresh = self.pool.take_new(count)
        loaded: list[int] = []
        for i, block_id in zip(missing, fresh):
            if not disk.load(block_keys[i], block_id):
                break
            self.pool.cache(block_id, block_keys[i], block_keys[i - 1] if i else None)
            chain[i] = block_id
            loaded.append(block_id)
        self.pool.release(fresh[len(loaded) :])  # taken for a load that failed or was not reached: keyless
        self.pool.release(reversed([b for b in chain if b is not None]))
        self._stored(block_keys, missing[: len(loaded)], token_ids)
        return len(loaded)

    def find_cached_prefix(
        self, block_keys: Sequence[BlockKey], num_prompt_tokens: int, from_start: bool = False
    ) -> PrefixHit:
        """Longest run of leading blocks whose keys are cached; changes nothing and counts nothing.

        At least one prompt token must be left to compute (its logits give the first output token), so a
        prompt of exactly k full blocks can reuse at most k - 1 of them. ``from_start``: the request
        recomputes every position over the hit (it scores its prompt); only windowed layers care.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0, 0, [])
        found = map(self.pool.lookup, block_keys[: max(num_prompt_tokens - 1, 0) // self.block_size])
        block_ids = list(takewhile(lambda block_id: block_id is not None, found))
        keys = list(block_keys[: len(block_ids)])
        return PrefixHit(block_ids, len(block_ids) * self.block_size, num_prompt_tokens, keys)

    def num_blocks_needed(self, request_id: str, num_tokens: int, prefix: PrefixHit | None = None) -> int:
        """Blocks `allocate` would take out of the free pool: new ones plus free cached ones it revives."""
        prefix_ids = prefix.block_ids if prefix is not None else []
        have = len(self._tables.get(request_id, ())) + len(prefix_ids)
        revived = sum(1 for block_id in prefix_ids if self.pool.ref_count(block_id) == 0)
        return max(0, -(-num_tokens // self.block_size) - have) + revived

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        prefix: PrefixHit | None = None,
        block_keys: Sequence[BlockKey] = (),
        num_computed_tokens: int = 0,
        token_ids: Sequence[int] = (),
    ) -> bool:
        """Make the request's block table cover positions [0, num_tokens); False changes no allocation.

        `prefix` (from `find_cached_prefix`, same step) is only accepted on the request's first call; its
        blocks become the head of the table before any new block is taken. First, the request's blocks full
        of its `num_computed_tokens` are cached under `block_keys` (whether or not the allocation succeeds);
        `token_ids` (the request's tokens) are only read for KV events.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self._cache_computed(request_id, block_keys, num_computed_tokens, token_ids)
        if prefix is not None:
            self._check_prefix(request_id, num_tokens, prefix)
        if self.num_blocks_needed(request_id, num_tokens, prefix) > self.pool.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        self._num_keyed.setdefault(request_id, 0)
        if prefix is not None:
            self.pool.touch(prefix.block_ids)
            self.pool.record_hits(prefix.block_ids)
            if self.disk is not None:
                self.disk.touch(prefix.block_keys)
            table.extend(prefix.block_ids)
            self._num_keyed[request_id] = len(prefix.block_ids)
            self.num_queried_tokens += prefix.num_queried_tokens
            self.num_hit_tokens += prefix.num_tokens
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new > 0:
            table.extend(self.pool.take_new(num_new))
        return True

    def _check_prefix(self, request_id: str, num_tokens: int, prefix: PrefixHit) -> None:
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has blocks; pass a prefix only on its first allocate()")
        if num_tokens < prefix.num_tokens:
            raise ValueError(f"allocate({num_tokens} tokens) must cover the {prefix.num_tokens} cached prefix tokens")
        if [self.pool.key_of(b) for b in prefix.block_ids] != prefix.block_keys:
            raise ValueError("stale PrefixHit: call find_cached_prefix() again right before allocate()")

    def cache_full_blocks(
        self,
        request_id: str,
        block_keys: Sequence[BlockKey],
        num_full_blocks: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Register the keys of the request's blocks [0, num_full_blocks) not registered yet.

        Call it only for blocks whose K/V has been written. If another block already holds the same key
        (two requests computed the same content concurrently) the existing mapping stays and this
        request's block stays unkeyed; both remain valid for their owners.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if table is None:
            raise ValueError(f"cache_full_blocks: unknown request {request_id!r}; allocate() it first")
        if num_full_blocks > len(table) or num_full_blocks > len(block_keys):
            raise ValueError(
                f"cache_full_blocks({num_full_blocks}) exceeds the request's {len(table)} blocks "
                f"or its {len(block_keys)} block keys"
            )
        start = self._num_keyed[request_id]
        disk, pool = self.disk, self.pool
        stored: list[int] = []
        for i in range(start, num_full_blocks):
            parent = block_keys[i - 1] if i else None
            if pool.lookup(block_keys[i]) is None and pool.cache(table[i], block_keys[i], parent):
                stored.append(i)
                if disk is not None:
                    disk.store(block_keys[i], parent, table[i])
        self._num_keyed[request_id] = max(start, num_full_blocks)
        self._stored(block_keys, stored, token_ids)

    def _cache_computed(
        self, request_id: str, block_keys: Sequence[BlockKey], num_computed_tokens: int, token_ids: Sequence[int]
    ) -> None:
        table = self._tables.get(request_id)
        if table and block_keys:
            num_full = min(num_computed_tokens // self.block_size, len(table), len(block_keys))
            if num_full > self._num_keyed[request_id]:
                self.cache_full_blocks(request_id, block_keys, num_full, token_ids)

    def free(
        self,
        request_id: str,
        block_keys: Sequence[BlockKey] = (),
        num_computed_tokens: int = 0,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Release the request's blocks, last block first, so its tail is evicted before its shared head;
        its blocks full of computed tokens are cached under `block_keys` first, for later hits."""
        self._cache_computed(request_id, block_keys, num_computed_tokens, token_ids)
        table = self._tables.pop(request_id, None)
        self._num_keyed.pop(request_id, None)
        if table:
            self.pool.release(reversed(table))

    def slide(
        self, request_id: str, block_keys: Sequence[BlockKey], num_computed_tokens: int, token_ids: Sequence[int] = ()
    ) -> None:
        """After each step of a request: nothing, full-attention blocks are read to the end (see hybrid.py)."""

    def miss_reason(self, block_keys: Sequence[BlockKey], prefix: PrefixHit, waited_for_block: int | None) -> str:
        """Why the prompt's cached prefix ends where ``prefix`` (this step's lookup) ends; see ``cache_report``."""
        pool = self.pool if self.enable_prefix_caching else None
        return cache_report.miss_reason(pool, block_keys, len(prefix.block_ids), waited_for_block)

    def block_tables(self) -> dict[str, list[int]]:
        """Every request's block table (copies), for the KV map."""
        return {request_id: list(table) for request_id, table in self._tables.items()}

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in position order (the live list: read, don't mutate); [] if unknown."""
        return self._tables.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        """Drop every cached key; only while no block is in use (True), otherwise nothing happens (False)."""
        return self.pool.reset()

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def ref_counts(self) -> list[int]:
        return self.pool.ref_counts()

    def stats(self) -> dict[str, int | float]:
        queries = self.num_queried_tokens
        return {
            "prefix_cache_queries": queries,
            "prefix_cache_hits": self.num_hit_tokens,
            "prefix_cache_hit_rate": self.num_hit_tokens / queries if queries else 0.0,
            "evictions": self.pool.num_evictions,
            "kv_blocks_total": self.num_total_blocks,
            "kv_blocks_free": self.num_free_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_cached": self.pool.num_cached_blocks(),  # keyed blocks, held or free
            **(self.disk.stats() if self.disk is not None else {}),
        }
