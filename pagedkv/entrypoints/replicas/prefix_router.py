"""Ray Serve request routers for the engine replicas: pagedkv's block-key affinity, and random (a baseline).

Ray Serve asks a router, for each request, for ranked lists of replicas; it sends the request to the
least-loaded replica of the first list that has a free slot (a replica takes at most ``max_num_seqs``
requests at once), falling back list by list. ``BlockKeyRouter`` ranks:

1. a prompt whose first blocks some replicas were sent before (``PrefixAffinity``: the longest match of
   its block keys): those replicas first -- unless the least loaded of them has ``max_queue_gap`` more
   requests than the least loaded replica overall, where waiting costs more than computing the prefix
   again; the request then goes by load, and its prefix is recorded on a second replica.
2. a prompt nobody was sent: the replica with the fewest requests, then the fewest recorded blocks, so
   new prefixes spread over the replicas.
3. no full block of prompt (GET routes, short prompts, bodies that are not requests): by load alone.

The router lives in each caller of the engine deployment (the ingress), and its memory of what it sent
where is that caller's; a replica's ``record_routing_stats`` reports its KV pool size, which bounds that
memory. This module imports Ray: only ``pagedkv serve --replicas`` loads it.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedkv.entrypoints.replicas.prefix_affinity import DEFAULT_BLOCKS_PER_REPLICA, PrefixAffinity

DEFAULT_MAX_QUEUE_GAP = 8


def _block_keys(pending_request: PendingRequest | None) -> tuple[bytes, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return getattr(pending_request.args[0], "block_keys", ())


class BlockKeyRouter(RequestRouter):
    def initialize_state(
        self, max_queue_gap: int = DEFAULT_MAX_QUEUE_GAP, default_capacity: int = DEFAULT_BLOCKS_PER_REPLICA
    ) -> None:
        self.max_queue_gap = max_queue_gap
        self.affinity = PrefixAffinity(default_capacity)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every candidate is in the ranks below
        keys = _block_keys(pending_request)
        if not keys:  # the least loaded, ties broken at random
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        by_id = {r.replica_id: r for r in candidate_replicas}
        for replica in candidate_replicas:
            capacity = replica.routing_stats.get("kv_blocks_total")
            if capacity:
                self.affinity.set_capacity(replica.replica_id, int(capacity))
        match = self.affinity.match(keys, list(by_id))
        if match.blocks:
            holders = [by_id[r] for r in match.replicas]
            if self._queue_len(holders) - self._queue_len(candidate_replicas) <= self.max_queue_gap:
                return [holders, [r for r in candidate_replicas if r.replica_id not in match.replicas]]
            return [candidate_replicas]
        ranked = sorted(
            candidate_replicas, key=lambda r: (self._queue_len([r]), self.affinity.num_blocks(r.replica_id))
        )
        return [ranked[:1], ranked[1:]]

    def _queue_len(self, replicas: list[RunningReplica]) -> int:
        """The shortest known queue among ``replicas`` (unknown counts as empty: it is probed on dispatch)."""
        return min(self.replica_queue_len_cache.get(r.replica_id) or 0 for r in replicas)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        keys = _block_keys(pending_request)
        if keys:
            self.affinity.record(keys, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for replica_id in self.affinity.replicas():
            if replica_id not in current:
                self.affinity.forget(replica_id)


class RandomRouter(RequestRouter):
    """Each request to a uniformly random replica with a free slot: the no-affinity baseline."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        return [[r] for r in shuffled]
