"""EngineCore: the model side of the engine -- scheduler, KV cache, runner, sampler. Token ids in and out.

It never sees text: requests arrive built and validated (``LLMEngine.make_requests``), and each step
reports per request what it computed, sampled and whether it finished (``CoreOutput``). Turning that into
text is the output processor's job, on whichever thread owns the tokenizer -- the caller's for ``LLM``,
the tokenizer worker's for the server -- so the thread that runs the model only runs the model.

Failures stay with their request: if the batched sampler raises, each request is sampled again on its own
and only the ones that still fail are stopped; the scheduler stops a request whose own update raises. Only
the model call itself can fail a whole step, and then just the requests scheduled in it are stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pagedkv.engine.request import CoreOutput, Request
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.scheduler import ScheduledRequest, Scheduler
from pagedkv.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler

    def add(self, requests: Sequence[Request]) -> None:
        """Queue built requests (the n samples of one prompt together)."""
        for request in requests:
            self.scheduler.add(request)

    def finish(self, request_ids: Sequence[str], reason: str, stop_reason: str | None = None) -> None:
        """Stop requests (abort, a stop string found by the output processor); unknown ids are ignored."""
        self.scheduler.finish_requests(list(request_ids), reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[CoreOutput]:
        """Schedule, run the model, sample, advance: what happened to each scheduled request."""
        step = self.scheduler.schedule()
        if not step.scheduled:
            return []
        try:
            result = self.runner.execute(step)
        except Exception:
            logger.exception("the model step failed; stopping the %d requests scheduled in it", len(step.scheduled))
            return [self.scheduler.fail(s.request) for s in step.scheduled]
        out, failed = self._sample(result.logits, [(step.scheduled[i], n) for i, n in result.sampled])
        return self.scheduler.update_from_output(step, result.sampled, out, failed, result.prompt_logprobs)

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
        row = 0
        for s, n in rows:
            try:
                part = self._sample_rows(logits[row : row + n], requests[row : row + n])
            except Exception:
                logger.exception("sampling failed for request %s", s.request.request_id)
                failed.add(s.request.request_id)
                part = SamplerOutput(token_ids=[0] * n)
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs or [0.0] * n
            out.top_logprobs += part.top_logprobs or [None] * n
            row += n
        return out, failed

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """The sampler reads a row's history only for penalties and min_tokens; other rows pass nothing,
        so plain decoding does not copy every request's prompt and output every step."""
        history = [_history(r) for r in requests]
        return self.sampler(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [h[0] for h in history],
            [h[1] for h in history],
        )

    def stats(self) -> dict[str, float]:
        scheduler = self.scheduler
        stats: dict[str, float] = dict(scheduler.kv.stats())
        stats.update(scheduler.counters)
        stats["num_requests_running"] = len(scheduler.running)
        stats["num_requests_waiting"] = len(scheduler.waiting)
        stats["num_preemptions"] = scheduler.num_preemptions
        return stats


def _history(request: Request) -> tuple[Sequence[int], Sequence[int]]:
    """(prompt, output) token ids as far as the sampler needs them for this request's parameters."""
    params = request.params
    if params.has_penalties:
        return request.prompt_token_ids, request.output_token_ids
    if params.min_tokens:
        return (), request.output_token_ids
    return (), ()
