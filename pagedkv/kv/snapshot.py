"""The KV map's data: every block's state, the hottest cached prefixes and the counters over time.

Two halves, because the engine's thread must not wait on formatting: ``read_engine`` copies the pool's
plain lists on the thread that owns the engine (O(blocks), no hashing, no allocation per block beyond the
copies), and ``snapshot_json`` turns the copy into the JSON of ``GET /kv.json`` anywhere else.

A block is in one of four states: ``held`` (one request's), ``shared`` (several requests'), ``cached``
(nobody's, but keyed: a later prompt can hit it; ranked by when it will be evicted, 0 = next) or
``empty`` (nobody's and keyless). Block keys are shown as short ids keyed with a secret drawn per process,
so the map shows the structure of the cache without letting anyone test whether a guessed prompt is in it
(a bare key hash would: hash the guess, look for it).

A model with sliding-window layers (Gemma 3) keeps their blocks in a second group (``pagedkv.kv.hybrid``): the
JSON's ``window_group`` lists that group's blocks in the same four states (a request holds only its last
window there; the null block, never handed out, is not listed), beside the full-attention group's ``blocks``.

The counters over time (:class:`CounterHistory`, the charts' data): the engine core offers a sample after every
step; one is kept per ``interval_s`` at most, in a ring of ``capacity`` samples (10 minutes at the defaults), so
recording costs one clock read per step and the memory is fixed. Counters are cumulative (as in ``stats()``);
rates over an interval are the reader's differences, so a sample that is skipped loses no event.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.kv.hashing import BlockKey
from pagedkv.kv.hybrid import HybridKVCacheManager
from pagedkv.kv.prefix_tree import build_prefix_tree

HELD, SHARED, CACHED, EMPTY = "held", "shared", "cached", "empty"
STATES = (HELD, SHARED, CACHED, EMPTY)
# One palette for the page and the PNG; cached blocks shade from `cached_next` (evicted next) to `cached_last`.
PALETTE = {
    HELD: "#ff9f1c",
    SHARED: "#d7263d",
    "cached_next": "#a6cee3",
    "cached_last": "#1f4e9c",
    EMPTY: "#e4e4e4",
}
MAX_REQUESTS_PER_BLOCK = 16  # request ids listed per block; `ref_count` still says how many hold it

_KEY_SECRET = os.urandom(16)


@dataclass(slots=True)
class PoolSnapshot:
    """Copies of one block group's pool state at one moment."""

    ref_counts: list[int]
    keys: list[BlockKey | None]
    parents: list[BlockKey | None]
    hits: list[int]
    free_order: list[int]  # free block ids, next handed out first
    tables: dict[str, list[int]]  # request id -> the block ids it holds


@dataclass(slots=True)
class KVSnapshot:
    """Copies of the pools' state at one moment, plus the engine's counters and their history."""

    time: float
    block_size: int
    prefix_caching: bool
    pool: PoolSnapshot  # the full-attention layers' (every layer's, without sliding-window layers)
    counters: dict[str, float]
    history: list[dict[str, float]]
    windowed: PoolSnapshot | None = None  # the sliding-window layers' group, where the KV manager keeps one
    window: int = 0


# The stats() fields the charts draw, and the names they are kept under.
RECORDED = {
    "prefix_cache_queries": "queries",
    "prefix_cache_hits": "hits",
    "evictions": "evictions",
    "num_preemptions": "preemptions",
    "kv_blocks_used": "blocks_used",
    "kv_blocks_cached": "blocks_cached",
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
}


class CounterHistory:
    """The cache counters over time, for the KV map's charts: one sample per ``interval_s`` at most, in a ring
    of ``capacity`` (see the module's docstring for why it is cheap)."""

    def __init__(self, interval_s: float = 0.5, capacity: int = 1200, clock: Callable[[], float] = time.time) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._samples: deque[dict[str, float]] = deque(maxlen=capacity)
        self._last = float("-inf")

    def offer(self, stats: Callable[[], dict[str, float]]) -> None:
        """Record ``stats()`` if ``interval_s`` passed since the last sample; ``stats`` is called only then,
        so a step between samples costs a clock read."""
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self._samples.append(_sample(now, stats()))

    def samples(self, current: dict[str, float] | None = None) -> list[dict[str, float]]:
        """Oldest first; each ``{"t": unix time, "queries": ..., "hits": ..., ...}`` (cumulative counters).
        ``current``: the stats of this moment, appended as a last sample (not kept), so a chart ends now."""
        samples = list(self._samples)
        if current is not None:
            samples.append(_sample(self._clock(), current))
        return samples


def _sample(now: float, stats: dict[str, float]) -> dict[str, float]:
    return {"t": now, **{name: float(stats.get(field, 0)) for field, name in RECORDED.items()}}


def read_pool(pool, tables: dict[str, list[int]]) -> PoolSnapshot:
    """Copy one :class:`BlockPool`'s state; ``tables``: each request's held block ids in it."""
    n = pool.num_blocks
    return PoolSnapshot(
        ref_counts=pool.ref_counts(),
        keys=[pool.key_of(b) for b in range(n)],
        parents=[pool.parent_key_of(b) for b in range(n)],
        hits=pool.hits(),
        free_order=pool.free_order(),
        tables=tables,
    )


def read_engine(core) -> KVSnapshot:
    """Copy what the map needs from an EngineCore: ``core.scheduler.kv``, its stats, and its counter history
    with the present as the last sample. Call it on the thread that owns the engine."""
    kv, stats = core.scheduler.kv, core.stats()
    windowed = kv.windowed if isinstance(kv, HybridKVCacheManager) else None
    window_pool = None
    if windowed is not None:  # each request's windowed blocks, less the null block of what slid out
        null = windowed.null_block
        tables = {r: [b for b in kv.window_block_table(r) if b != null] for r in kv.block_tables()}
        window_pool = read_pool(windowed.pool, tables)
    return KVSnapshot(
        time=time.time(),
        block_size=kv.block_size,
        prefix_caching=kv.enable_prefix_caching,
        pool=read_pool(kv.pool, kv.block_tables()),
        counters=stats,
        history=core.history.samples(current=stats),
        windowed=window_pool,
        window=windowed.window if windowed is not None else 0,
    )


def key_id(key: BlockKey | None) -> str | None:
    """A block key as 12 hex digits, keyed with this process's secret (stable while it runs)."""
    if key is None:
        return None
    return hashlib.blake2b(key, key=_KEY_SECRET, digest_size=6).hexdigest()


def block_state(ref_count: int, key: BlockKey | None) -> str:
    if ref_count >= 2:
        return SHARED
    if ref_count == 1:
        return HELD
    return CACHED if key is not None else EMPTY


def pool_json(pool: PoolSnapshot) -> dict:
    """One group's blocks: ``blocks`` (one entry each), ``counts`` per state, ``num_blocks``, ``num_cached_free``."""
    holders: dict[int, list[str]] = {}
    for request_id, table in sorted(pool.tables.items()):
        for block_id in table:
            holders.setdefault(block_id, []).append(request_id)
    cached_free = [block_id for block_id in pool.free_order if pool.keys[block_id] is not None]
    eviction_rank = {block_id: rank for rank, block_id in enumerate(cached_free)}
    blocks = []
    counts = dict.fromkeys(STATES, 0)
    for block_id, (ref_count, key) in enumerate(zip(pool.ref_counts, pool.keys)):
        state = block_state(ref_count, key)
        counts[state] += 1
        blocks.append(
            {
                "id": block_id,
                "state": state,
                "ref_count": ref_count,
                "key": key_id(key),
                "parent": key_id(pool.parents[block_id]),
                "hits": pool.hits[block_id],
                "eviction_rank": eviction_rank.get(block_id),
                "requests": holders.get(block_id, [])[:MAX_REQUESTS_PER_BLOCK],
            }
        )
    return {"num_blocks": len(blocks), "counts": counts, "num_cached_free": len(eviction_rank), "blocks": blocks}


def snapshot_json(snap: KVSnapshot) -> dict:
    """The body of ``GET /kv.json``: one entry per block, the state counts, the prefix tree, the counters, and
    the sliding-window layers' group (``window_group``: None where the model has none)."""
    full = pool_json(snap.pool)
    window_group = None
    if snap.windowed is not None:
        window_group = {"window": snap.window, **pool_json(snap.windowed)}
    return {
        "time": snap.time,
        "block_size": snap.block_size,
        "num_blocks": full["num_blocks"],
        "prefix_caching": snap.prefix_caching,
        "counts": full["counts"],
        "num_cached_free": full["num_cached_free"],
        "counters": snap.counters,
        "history": snap.history,
        "prefix_tree": build_prefix_tree(full["blocks"]),
        "palette": PALETTE,
        "blocks": full["blocks"],
        "window_group": window_group,
    }
