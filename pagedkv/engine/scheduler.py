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
from dataclasses import dataclass, field

from pagedkv.engine import speculative
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.kv.hashing import BlockKey, extend_block_keys
from pagedkv.kv.manager import KVCacheManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens to compute, plus the drafts
    draft_token_ids: list[int] = field(default_factory=list)  # guessed next tokens, run after the last one


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes (one new token, maybe with drafts) first, then prefill chunks
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
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
        draft_len = self._draft_length()
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, min(draft_len, budget - 1)) if num_new == 1 and draft_len else []
            if drafts and not self.kv.allocate(request.request_id, request.num_tokens + len(drafts)):
                drafts = []  # a guess never preempts anyone
            while not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
                i += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1 and not s.draft_token_ids)
        return SchedulerOutput(scheduled, preempted)

    def _draft_length(self) -> int:
        """Drafts per decoding request this step: all of ``num_speculative_tokens`` while the step's decode
        rows stay within ``speculative.MAX_ROWS``, fewer as the batch grows, none for a large batch."""
        if not self.num_speculative_tokens:
            return 0
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        return max(0, min(self.num_speculative_tokens, speculative.MAX_ROWS // max(decoding, 1) - 1))

    def _drafts(self, request: Request, limit: int) -> list[int]:
        """Drafts for a decoding request: within ``limit``, its max_tokens (the model's own token after the
        drafts comes too) and the model's context length."""
        if limit < 1 or not speculative.can_speculate(request):
            return []
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - request.num_tokens - 1)
        return speculative.propose(request.token_ids, limit)

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
