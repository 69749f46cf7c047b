"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no separate prefill and decode phases (like vLLM v1): every step, each request is asked for the
number of tokens it still has to compute -- one for a decode, the rest of the prompt for a prefill -- and
gets as many as the step's token budget allows. Running requests go first, so decodes are never starved by
a long prompt; a long prompt is simply cut into chunks over several steps.

When the pool runs out of blocks, the most recently admitted running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue. Its full blocks keep their prefix-cache keys, so
recomputing it later is mostly cache hits.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from pagedkv.engine.request import Request, RequestStatus
from pagedkv.kv.hashing import BlockKey, extend_block_keys
from pagedkv.kv.manager import KVCacheManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # requests with one new token first, then the prefill chunks
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.extend_keys(request, request.num_tokens // self.kv.block_size)
        self.waiting.append(request)

    def extend_keys(self, request: Request, num_full_blocks: int) -> None:
        """Key the request's first ``num_full_blocks`` blocks (only the ones not keyed yet are hashed)."""
        if self.kv.enable_prefix_caching and num_full_blocks > len(request.block_keys):
            tokens = request.token_ids[: num_full_blocks * self.kv.block_size]
            extend_block_keys(request.block_keys, tokens, self.kv.block_size, request.cache_salt)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return SchedulerOutput(scheduled, preempted)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit waiting requests in arrival order while blocks, budget and seats last.

        A request whose next uncached block is being computed right now by another request (same system
        prompt, or the n samples of one request) waits a step instead: next step that block is a cache hit,
        so a burst of requests sharing a prefix computes it once, not once per request.
        """
        in_flight = self._in_flight_keys()
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            hit = self.kv.find_cached_prefix(request.block_keys, request.num_tokens)
            first_new_block = len(hit.block_ids)
            if first_new_block < len(request.block_keys) and request.block_keys[first_new_block] in in_flight:
                deferred.append(request)
                continue
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            if not self.kv.allocate(request.request_id, hit.num_tokens + num_new, prefix=hit):
                self.waiting.appendleft(request)
                break
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            in_flight.update(request.block_keys[first_new_block : request.num_prompt_tokens // self.kv.block_size])
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _in_flight_keys(self) -> set[BlockKey]:
        """Keys of prompt blocks that running requests have yet to compute."""
        if not self.kv.enable_prefix_caching:
            return set()
        block_size = self.kv.block_size
        keys: set[BlockKey] = set()
        for request in self.running:
            if request.is_prefilling:
                keys.update(
                    request.block_keys[
                        request.num_computed_tokens // block_size : request.num_prompt_tokens // block_size
                    ]
                )
        return keys

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        logger.debug("preempted %s (pool out of blocks)", request.request_id)

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark finished and give its blocks back (full blocks stay cached for later hits)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv.free(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
