"""PrefixAffinity: which replica was sent which prompt blocks, so a prompt goes where its prefix is cached.

The router's memory is keyed by pagedkv's own block keys (``pagedkv.kv.hashing``). A key commits to every
token before it and to the cache salt, so "replica r was sent block key k" means r computed the whole
prefix ending at k -- for the same tenant -- and may still hold it. Matching is therefore exact at block
granularity: a match of m blocks is the m * block_size tokens the replica's prefix cache can reuse, no
more (a character-level match can promise hits that a block boundary takes away) and no less.

Each replica's record is an LRU bounded by that replica's KV pool size (in blocks), touched the way the
engine's own pool is: a request's blocks are recorded tail first, so its shared head is the most recent
and is forgotten last, as the engine frees a finished request's blocks tail first. The record can only
approximate the replica's cache (other tenants' traffic evicts blocks there too), but it never claims a
replica holds more blocks than its pool has.

No Ray here: the Ray Serve router (``prefix_router``) is a thin wrapper, and this is unit-tested alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

from pagedkv.kv.hashing import BlockKey

ReplicaKey = Hashable

# Before a replica reports its pool size, its record holds at most this many keys (32 bytes each).
DEFAULT_BLOCKS_PER_REPLICA = 1 << 16


@dataclass(frozen=True, slots=True)
class Match:
    """The longest cached prefix of a prompt among some replicas: ``blocks`` full blocks, on ``replicas``."""

    blocks: int
    replicas: tuple[ReplicaKey, ...]


class PrefixAffinity:
    def __init__(self, default_capacity: int = DEFAULT_BLOCKS_PER_REPLICA) -> None:
        if default_capacity < 1:
            raise ValueError(f"default_capacity must be >= 1, got {default_capacity}")
        self.default_capacity = default_capacity
        self._owners: dict[BlockKey, set[ReplicaKey]] = {}
        self._records: dict[ReplicaKey, OrderedDict[BlockKey, None]] = {}
        self._capacity: dict[ReplicaKey, int] = {}

    def match(self, keys: Sequence[BlockKey], replicas: Collection[ReplicaKey]) -> Match:
        """The replicas among ``replicas`` that were sent the longest prefix of ``keys``.

        Walks the chain from its first block while some replica still holds it: block i's key covers
        blocks 0..i, so holding key i is what counts, and the walk stops at the first block nobody holds.
        """
        holders = set(replicas)
        matched = 0
        for key in keys:
            still = holders & self._owners.get(key, set())
            if not still:
                break
            holders, matched = still, matched + 1
        if matched == 0:
            return Match(0, ())
        return Match(matched, tuple(r for r in replicas if r in holders))

    def record(self, keys: Sequence[BlockKey], replica: ReplicaKey) -> None:
        """``replica`` was sent a prompt with these block keys: remember them, forgetting its oldest beyond
        its capacity."""
        record = self._records.setdefault(replica, OrderedDict())
        for key in reversed(keys):  # tail first: the shared head ends up the most recent
            if key in record:
                record.move_to_end(key)
            else:
                record[key] = None
                self._owners.setdefault(key, set()).add(replica)
        self._evict(replica, self._capacity.get(replica, self.default_capacity))

    def set_capacity(self, replica: ReplicaKey, num_blocks: int) -> None:
        """The replica's KV pool holds ``num_blocks`` blocks: its record keeps no more keys than that."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._capacity[replica] = num_blocks
        self._evict(replica, num_blocks)

    def forget(self, replica: ReplicaKey) -> None:
        """The replica is gone (died, scaled down): its cache went with it."""
        for key in self._records.pop(replica, OrderedDict()):
            self._drop_owner(key, replica)
        self._capacity.pop(replica, None)

    def num_blocks(self, replica: ReplicaKey) -> int:
        """Blocks recorded for ``replica``: how much of the working set it holds, for spreading new prefixes."""
        return len(self._records.get(replica, ()))

    def replicas(self) -> list[ReplicaKey]:
        return list(self._records)

    def _evict(self, replica: ReplicaKey, capacity: int) -> None:
        record = self._records.get(replica)
        while record is not None and len(record) > capacity:
            key, _ = record.popitem(last=False)
            self._drop_owner(key, replica)

    def _drop_owner(self, key: BlockKey, replica: ReplicaKey) -> None:
        owners = self._owners.get(key)  # always there while the records agree; the router must not fail if not
        if owners is None:
            return
        owners.discard(replica)
        if not owners:
            del self._owners[key]
