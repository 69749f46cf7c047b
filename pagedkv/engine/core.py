"""EngineCore: the model side of the engine -- scheduler, KV cache, runner, sampler. Token ids in and out.

It never sees text: requests arrive built and validated (``LLMEngine.make_requests``), and each step
reports per request what it computed, sampled and whether it finished (``CoreOutput``). Turning that into
text is the output processor's job; ``EngineLoop`` hands one to the other.

Failures stay with their request: if the batched sampler raises, each request is sampled again on its own
and only the ones that still fail are stopped; the scheduler stops a request whose own update raises. Only
the model call itself can fail a whole step, and then just the requests scheduled in it are stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from pagedkv import structured
from pagedkv.engine.request import CoreOutput, Request
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pagedkv.kv.events import KVEventPublisher
from pagedkv.kv.snapshot import CounterHistory
from pagedkv.parallel.workers import TensorParallelFailure
from pagedkv.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, kv_events: KVEventPublisher | None = None
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self._vocab_size = runner.model.spec.vocab_size
        self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-grammar")
        self.history = CounterHistory()  # the cache counters over time, for the KV map
        self.kv_events = kv_events  # where each step's KV events go (None: nowhere)

    def add(self, requests: Sequence[Request]) -> None:
        """Queue built requests (the n samples of one prompt together)."""
        for request in requests:
            self.scheduler.add(request)

    def finish(self, request_ids: Sequence[str], reason: str, stop_reason: str | None = None) -> None:
        """Stop requests (abort, a stop string found by the output processor); unknown ids are ignored."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)  # unfinished requests only
            if request is not None:
                self.scheduler.finish(request, reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)  # every unfinished request, waiting or running

    def step(self) -> list[CoreOutput]:
        """Schedule, run the model, sample, advance: what happened to each scheduled request."""
        try:
            return self._step()
        finally:
            self.publish_kv_events()

    def publish_kv_events(self) -> None:
        """Send the KV events recorded since the last call as one batch (KV events on only)."""
        recorder = self.scheduler.kv.events
        if self.kv_events is not None and recorder is not None:
            self.kv_events.publish(recorder.take())

    def _step(self) -> list[CoreOutput]:
        step = self.scheduler.schedule()
        if not step.scheduled:
            return []
        # Grammar masks are computed on another thread while the model runs (llguidance releases the GIL).
        masking = None
        if any(s.request.grammar is not None for s in step.scheduled):
            masking = self._mask_thread.submit(self._grammar_masks, step)
        try:
            result = self.runner.execute(step)
        except TensorParallelFailure:
            raise  # no step can run any more: stop the engine with the error
        except Exception:
            logger.exception("the model step failed; stopping the %d requests scheduled in it", len(step.scheduled))
            if masking is not None:
                masking.result()  # the matchers are the step's own until the thread is done with them
            return [self.scheduler.fail(s.request) for s in step.scheduled]
        rows = [(step.scheduled[i], n) for i, n in result.sampled]
        failed: set[str] = set()
        if masking is not None:
            masks, failed = masking.result()
            _apply_grammar_masks(result.logits, rows, masks)
        out, sampling_failed = self._sample(result.logits, rows)
        outputs = self.scheduler.update_from_output(
            step, result.sampled, out, failed | sampling_failed, result.prompt_logprobs, result.pooled
        )
        self.history.offer(self.stats)
        return outputs

    def _grammar_masks(self, step: SchedulerOutput) -> tuple[dict[str, torch.Tensor], set[str]]:
        """Allowed-token bitmasks of the step's sampled rows with a grammar, by request id; a request whose
        matcher fails is reported (and stopped with "error") rather than failing the step."""
        masks: dict[str, torch.Tensor] = {}
        failed: set[str] = set()
        for s in step.scheduled:
            grammar = s.request.grammar
            if grammar is None or not s.is_sampled:
                continue
            try:
                masks[s.request.request_id] = structured.fill_masks(grammar, s.draft_token_ids, self._vocab_size)
            except Exception:
                logger.exception("the grammar of request %s failed; stopping it", s.request.request_id)
                failed.add(s.request.request_id)
        return masks, failed

    def _sample(self, logits: torch.Tensor, rows: list[tuple[ScheduledRequest, int]]) -> tuple[SamplerOutput, set[str]]:
        """One batched sampler call; if it raises, each request alone, so only a request at fault fails.

        Returns the per-row output and the ids of requests whose rows could not be sampled (their rows hold 0).
        """
        requests = [s.request for s, n in rows for _ in range(n)]
        if not requests:  # a step of prefill chunks (and prompts only scored) samples nothing
            return SamplerOutput(token_ids=[]), set()
        try:
            return self._sample_rows(logits, requests), set()
        except Exception:
            logger.exception("the batched sampler failed; sampling each request alone")
        out = SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])
        failed: set[str] = set()
        for (s, n), request_logits in zip(rows, logits.split([n for _, n in rows]), strict=True):
            try:
                part = self._sample_rows(request_logits, [s.request] * n)
            except Exception:
                logger.exception("sampling failed for request %s", s.request.request_id)
                failed.add(s.request.request_id)
                part = SamplerOutput(token_ids=[0] * n)
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs or [0.0] * n
            out.top_logprobs += part.top_logprobs or [None] * n
        return out, failed

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """The sampler reads a row's history only for penalties and min_tokens; other rows pass nothing,
        so plain decoding does not copy every request's prompt and output every step."""
        return self.sampler(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [r.prompt_token_ids if r.params.has_penalties else () for r in requests],
            [r.output_token_ids if r.params.has_penalties or r.params.min_tokens else () for r in requests],
        )

    def stats(self) -> dict[str, float]:
        scheduler = self.scheduler
        stats: dict[str, float] = dict(scheduler.kv.stats())
        stats.update(scheduler.counters)
        stats["num_requests_running"] = len(scheduler.running)
        stats["num_requests_waiting"] = len(scheduler.waiting)
        return stats


def _apply_grammar_masks(
    logits: torch.Tensor, rows: list[tuple[ScheduledRequest, int]], masks: dict[str, torch.Tensor]
) -> None:
    """Mask the logits rows of requests with a grammar; the other rows keep every token."""
    if not masks:
        return
    allow_all = torch.full((1, structured.bitmask_words(logits.shape[1])), -1, dtype=torch.int32)
    full = torch.cat([masks.get(s.request.request_id, allow_all.expand(n, -1)) for s, n in rows])
    structured.apply_masks(logits, full)
