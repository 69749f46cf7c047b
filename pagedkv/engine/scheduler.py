"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

There are no separate prefill and decode phases (like vLLM v1): every step, each request is asked for the
number of tokens it still has to compute -- one for a decode, the rest of the prompt for a prefill -- and
gets as many as the step's token budget allows. Running requests go first, and decodes before prompts: while
any request decodes, prompts share a smaller budget (``max_prefill_tokens_with_decodes``), so a long prompt
is cut into short chunks over several steps and no stream waits long for its next token.

Seats are shared between requests, not samples, and a step's prompt budget shrinks while requests decode:
that policy is ``admission.FairShare``'s (issue 25 rows 5 and 6); the scheduler applies it.

When the pool runs out of blocks, the most recently admitted running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue. Its full blocks keep their prefix-cache keys, so
recomputing it later is mostly cache hits.

The scheduler owns every step transition of a request (vLLM v1's ``update_from_output``): after the model
ran, it advances ``num_computed_tokens``, verifies drafts, appends the sampled tokens, applies the
token-level stops (EOS, stop token ids, max_tokens, max_model_len) and frees what finished. Text-level
stops (stop strings) are the output processor's, which asks for them through ``EngineCore.finish``.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.engine import speculative
from pagedkv.engine.admission import FairShare, PrefillBudget
from pagedkv.engine.pooling import keep, needs_every_row, pool
from pagedkv.engine.request import CoreOutput, PromptLogprob, Request
from pagedkv.kv.hashing import BlockKey
from pagedkv.kv.manager import KVCacheManager, PrefixHit
from pagedkv.sampler import SamplerOutput

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens to compute this step (a decode: 1)
    draft_token_ids: list[int] = field(default_factory=list)  # guessed next tokens, run after the last one

    @property
    def num_scheduled_tokens(self) -> int:
        """Rows this request puts into the step: its new tokens and its drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def is_sampled(self) -> bool:
        """Whether this step samples for it: it reaches the end of its known tokens (a decode, or its last
        prefill chunk), unless it only scores its prompt (max_tokens=0)."""
        request = self.request
        end = request.num_computed_tokens + self.num_new_tokens
        return end == request.num_tokens and request.params.max_tokens != 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # in scheduling order, which is also the order of the step's rows


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        max_seqs_per_group: int,
        max_prefill_tokens_with_decodes: int,
    ) -> None:
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.fair = FairShare(max_num_seqs, max_num_batched_tokens, max_seqs_per_group, max_prefill_tokens_with_decodes)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.counters = dict.fromkeys(
            (
                "prompt_tokens_computed",
                "generation_tokens",
                "requests_finished",
                "requests_failed",
                "draft_tokens",
                "draft_tokens_accepted",
                "num_preemptions",
            ),
            0,
        )

    @property
    def max_seqs_per_group(self) -> int:
        """Seats one request's n samples hold while others wait."""
        return self.fair.max_seqs_per_group

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        self._reclaim_seats()
        budget = self.max_num_batched_tokens
        prefill = self.fair.prefill_budget(self.running, bool(self.waiting) and len(self.running) < self.max_num_seqs)
        scheduled: list[ScheduledRequest] = []
        preempted = 0
        i = 0
        draft_len = speculative.draft_length(self.running, self.num_speculative_tokens)
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            prefilling = num_new > 1
            if prefilling:  # a prefill chunk
                num_new = min(num_new, budget, prefill.chunk(request, request.num_computed_tokens))
                if num_new == 0:  # this step's prefill budget is spent: its prompt goes on next step
                    i += 1
                    continue
            limit = 0 if prefilling else min(draft_len, budget - 1)
            drafts = speculative.drafts_for(request, limit, self.max_model_len)
            if drafts and not self._allocate(request, request.num_tokens + len(drafts)):
                drafts = []  # a guess never preempts anyone
            while not self._allocate(request, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new, drafts))
                budget -= num_new + len(drafts)
                if prefilling:
                    prefill.spend(request, request.num_computed_tokens, num_new)
                i += 1
        if not preempted:
            self._admit_waiting(budget, prefill, scheduled)
        return SchedulerOutput(scheduled)

    def _reclaim_seats(self) -> None:
        """Preempt the samples past their request's share of seats that requests waiting below theirs need
        (``FairShare.seats_to_reclaim``)."""
        for victim in self.fair.seats_to_reclaim(self.running, self.waiting):
            self.running.remove(victim)
            self._preempt(victim, "seat share")

    def _allocate(self, request: Request, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Blocks for ``num_tokens``; the KV manager first caches the blocks full of computed tokens."""
        return self.kv.allocate(
            request.request_id,
            num_tokens,
            prefix,
            request.block_keys,
            request.num_computed_tokens,
            request.event_token_ids,
        )

    def _admit_waiting(self, budget: int, prefill: PrefillBudget, scheduled: list[ScheduledRequest]) -> None:
        """Admit waiting requests while blocks, prompt budget and seats last, fairly between requests.

        The next seat goes to the waiting request (group of n samples) holding the fewest seats, the earliest
        in the queue among equals, so one request's samples do not fill every seat ahead of later requests;
        and none takes more than ``max_seqs_per_group`` seats while a request holding fewer waits (one held
        back a step below counts: it would take the seat back by preemption next step). Seats are never left
        idle while requests wait: beyond their shares, requests take the free seats in turn.

        A request whose next uncached block is being computed right now by another request (same system
        prompt, or the n samples of one request) waits a step instead: next step that block is a cache hit,
        so a burst of requests sharing a prefix computes it once, not once per request.
        """
        in_flight = self._in_flight_keys()
        seats = Counter(r.group_id for r in self.running)
        queues: dict[str, deque[Request]] = {}
        for request in self.waiting:
            queues.setdefault(request.group_id, deque()).append(request)
        held_back: set[str] = set()  # groups with a request deferred this step
        turns = [(seats[group], order, group) for order, group in enumerate(queues)]
        heapq.heapify(turns)
        admitted: set[str] = set()
        while turns and min(budget, prefill.left) > 0 and len(self.running) < self.max_num_seqs:
            _, order, group = heapq.heappop(turns)
            queue = queues[group]
            if seats[group] >= self.max_seqs_per_group and self.fair.below_share(held_back - {group}, seats):
                continue  # its share is taken while a request below its own waits: its samples stay queued
            request = queue.popleft()
            if queue:
                heapq.heappush(turns, (seats[group] + 1, order, group))  # as if admitted; a deferral lags a turn
            scorer = request.scorer
            if scorer is not None and not (scorer.prompt_scored or scorer.is_finished):
                held_back.add(group)
                continue  # its prompt's logprobs come first (see Request.scorer)
            found = self._cached_prefix(request, in_flight)
            if found is None:  # its next block is being computed: a hit next step
                held_back.add(group)
                continue
            hit, start = found
            num_new = min(request.num_tokens - start, budget, prefill.chunk(request, start))
            if num_new == 0 or not self._allocate(request, max(hit.num_tokens, start + num_new), prefix=hit):
                break
            self._start(request, hit, start)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            prefill.spend(request, start, num_new)
            seats[group] += 1
            admitted.add(request.request_id)
            in_flight.update(request.block_keys[len(hit.block_ids) : request.num_prompt_tokens // self.kv.block_size])
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.request_id not in admitted)

    def _cached_prefix(self, request: Request, in_flight: set[BlockKey]) -> tuple[PrefixHit, int] | None:
        """The request's cached prefix and the position its prefill starts at; None while its first uncached
        block is in ``in_flight`` (being computed by a running request), which ``waited_for_block`` records."""
        self.kv.load_from_disk(request.block_keys, request.num_tokens, request.event_token_ids)  # kv_cache_dir
        # Scoring the prompt or pooling every row needs every position: its prefill starts at 0 over the
        # cached blocks (their K/V is read, not written again), as much work as a cold run and never more.
        from_start = request.scores_prompt or needs_every_row(request.params.pooling)
        hit = self.kv.find_cached_prefix(request.block_keys, request.num_tokens, from_start)
        first_new_block = len(hit.block_ids)
        if first_new_block < len(request.block_keys) and request.block_keys[first_new_block] in in_flight:
            if request.waited_for_block is None:
                request.waited_for_block = first_new_block
            return None
        return hit, 0 if from_start else hit.num_tokens

    def _start(self, request: Request, hit: PrefixHit, start: int) -> None:
        """Move an admitted request to running, its prefix counted (the first admission's, for the report)."""
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.num_tokens
            request.cache_miss_reason = self.kv.miss_reason(request.block_keys, hit, request.waited_for_block)
        request.num_hit_tokens = hit.num_tokens
        request.num_computed_tokens = start
        self.running.append(request)

    def _in_flight_keys(self) -> set[BlockKey]:
        """Keys of prompt blocks that running requests have yet to compute."""
        if not self.kv.enable_prefix_caching:
            return set()
        size = self.kv.block_size
        return {
            key
            for r in self.running
            if r.is_prefilling
            for key in r.block_keys[r.num_computed_tokens // size : r.num_prompt_tokens // size]
        }

    def _preempt(self, request: Request, why: str = "pool out of blocks") -> None:
        self.kv.free(request.request_id, request.block_keys, request.num_computed_tokens, request.event_token_ids)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.counters["num_preemptions"] += 1
        logger.debug("preempted %s (%s)", request.request_id, why)

    # -- after the model ran ----------------------------------------------------------------------------

    def update_from_output(
        self,
        step: SchedulerOutput,
        sampled: list[tuple[int, int]],
        out: SamplerOutput,
        failed: set[str],
        prompt_logprobs: dict[int, tuple[int, list[PromptLogprob]]],
        pooled: dict[int, tuple[int, Tensor]] | None = None,
    ) -> list[CoreOutput]:
        """Advance every scheduled request by what the step computed and sampled; one CoreOutput each.

        ``sampled``: ``(index in step.scheduled, rows)`` of the requests that got logits rows, in row order
        (``rows`` is 1 + drafts). ``failed``: ids whose rows could not be sampled. ``prompt_logprobs``: by
        index in step.scheduled, the prompt logprobs computed for it (the runner's); ``pooled`` likewise the
        final hidden states its pooling keeps. A request whose update raises is stopped with "error" alone;
        the others go on.
        """
        rows_of: dict[int, tuple[int, int]] = {}
        row = 0
        for i, n in sampled:
            rows_of[i] = (row, n)
            row += n
        outputs = []
        for i, s in enumerate(step.scheduled):
            request = s.request
            if request.is_finished:
                continue
            try:
                if request.request_id in failed:
                    raise RuntimeError("sampling failed")
                embedding = self._pool(request, s, pooled.get(i) if pooled else None)
                core = self._advance(s, rows_of.get(i), out)
                if not request.is_finished:  # windowed layers: release the blocks that slid out of the window
                    self.kv.slide(
                        request.request_id, request.block_keys, request.num_computed_tokens, request.event_token_ids
                    )
                core.prompt_logprobs = prompt_logprobs.get(i)
                core.embedding = embedding
                outputs.append(core)
            except Exception:
                logger.exception("request %s failed; stopping it", request.request_id)
                outputs.append(self.fail(request))
        return outputs

    @staticmethod
    def _pool(request: Request, s: ScheduledRequest, chunk: tuple[int, Tensor] | None) -> list[float] | None:
        """Keep a pooling request's rows of this step; its embedding once this step completes its prompt
        (before the request is finished, so a failure here fails it with "error")."""
        pooling = request.params.pooling
        if pooling is None or chunk is None:
            return None
        request.pooled_rows = keep(request.pooled_rows, pooling, request.num_prompt_tokens, *chunk)
        done = request.num_computed_tokens + s.num_new_tokens >= request.num_prompt_tokens
        return pool(pooling, request.pooled_rows) if done else None

    def _advance(self, s: ScheduledRequest, rows: tuple[int, int] | None, out: SamplerOutput) -> CoreOutput:
        """Count the step's computed tokens; with logits rows, keep the verified drafts and the new token.

        A step computed K/V for the last token and every draft, but only the accepted drafts' entries are
        right (a rejected draft was not the real token): those count as computed, and the wrong slots are
        simply overwritten later. Tokens are appended one by one, so a token-level stop ends the run.
        """
        request = s.request
        start = request.num_computed_tokens
        request.num_computed_tokens += s.num_new_tokens
        self.counters["prompt_tokens_computed"] += max(
            0, min(request.num_prompt_tokens, request.num_computed_tokens) - start
        )
        if request.scores_prompt and not request.is_prefilling:
            request.prompt_scored = True
        if rows is None:  # a prefill chunk with more to come, or a prompt to score only (max_tokens=0)
            if request.params.max_tokens == 0 and not request.is_prefilling:
                self.finish(request, "length")
            return CoreOutput.of(request, [])
        first, n = rows
        chosen = out.token_ids[first : first + n]
        accepted = speculative.accepted_length(s.draft_token_ids, chosen)
        self.counters["draft_tokens"] += len(s.draft_token_ids)
        self.counters["draft_tokens_accepted"] += accepted
        request.num_computed_tokens += accepted
        new: list[int] = []
        for token in chosen[: accepted + 1]:
            request.append_tokens([token])
            new.append(token)
            if self._check_stop(request, token):
                break
        self.counters["generation_tokens"] += len(new)
        core = CoreOutput.of(request, new)
        if request.params.logprobs is not None and out.logprobs is not None:
            core.logprobs = out.logprobs[first : first + len(new)]
            core.top_logprobs = [t or [] for t in out.top_logprobs[first : first + len(new)]]
        return core

    def _check_stop(self, request: Request, token: int) -> bool:
        """EOS, a stop token id (after min_tokens), max_tokens or max_model_len: finish, and say so."""
        params = request.params
        eos = token in self.eos_token_ids and not params.ignore_eos
        if request.num_output_tokens >= params.min_tokens and (eos or token in params.stop_token_id_set):
            request.stopped_on_token = True
            self.finish(request, "stop", None if eos else token)
            return True
        if request.grammar is not None and request.grammar.is_stopped():  # the structure is complete
            self.finish(request, "stop")
            return True
        at_max_tokens = params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        if at_max_tokens or request.num_tokens >= self.max_model_len:
            self.finish(request, "length")
            return True
        return False

    def fail(self, request: Request) -> CoreOutput:
        """Stop a request with finish_reason "error" (its blocks freed); the CoreOutput reports it. One its
        failed update had already finished ("length" at max_tokens, say) is failed too: the error wins, or
        the client would get a normal finish and lose the error."""
        if request.finish_reason in ("stop", "length"):  # finished and freed: only the reason changes
            self.counters["requests_finished"] -= 1
            self.counters["requests_failed"] += 1
            request.finish_reason, request.stop_reason = "error", None
        self.finish(request, "error")
        return CoreOutput.of(request, [])

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark finished and give its blocks back (its computed full blocks are cached for later hits)."""
        if request.is_finished:
            return
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv.free(request.request_id, request.block_keys, request.num_computed_tokens, request.event_token_ids)
        self.requests.pop(request.request_id, None)
        if reason in ("stop", "length"):
            self.counters["requests_finished"] += 1
        elif reason == "error":
            self.counters["requests_failed"] += 1
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
