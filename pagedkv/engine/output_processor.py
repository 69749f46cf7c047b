"""OutputProcessor: the engine's text side -- detokenizing, stop strings, streaming cursors, RequestOutputs.

The scheduler reports what each step did to each request as token ids (``CoreOutput``); everything that
needs the tokenizer happens here, so the core never touches text and all tokenizer use is on one side.
Per request group (the n samples of one prompt) it keeps the output tokens, logprobs, the incremental
detokenizer and how much was already reported, and builds the caller's ``RequestOutput``: cumulative,
deltas only, or only the final one (``OutputKind``). A stop string that completes is reported back, so
the scheduler can stop that request and free its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.request import (
    INTERNAL_ERROR,
    CompletionOutput,
    CoreOutput,
    OutputKind,
    PromptLogprob,
    Request,
    RequestOutput,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampleState:
    """The output side of one sequence."""

    request_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    wants_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    emitted_tokens: int = 0  # output tokens already reported in a delta
    emitted_text: int = 0  # characters of output text already reported
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class GroupState:
    """One prompt's n samples, reported together as one RequestOutput."""

    group_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: OutputKind
    samples: list[SampleState]
    arrival_time: float = field(default_factory=time.perf_counter)
    num_cached_tokens: int = 0
    cache_miss_reason: str | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt position (None for the first), filled as the
    # prefill chunks are scored; every output carries the list (not a copy) once every position has one
    prompt_logprobs: list[PromptLogprob | None] | None = None
    prompt_logprobs_ready: bool = False
    embedding: list[float] | None = None  # with SamplingParams.pooling, once the prompt is done

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass(slots=True)
class Stop:
    """A request the processor wants the scheduler to finish (a stop string, or an error here)."""

    request_id: str
    reason: str
    stop_reason: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, GroupState] = {}
        self._samples: dict[str, tuple[GroupState, SampleState]] = {}

    def make_group(self, requests: Sequence[Request], prompt: str | None, output_kind: OutputKind) -> GroupState:
        """The output state of a new request group (the n built requests of one prompt); ``add`` registers it
        (building it may raise, adding not)."""
        params, prompt_token_ids = requests[0].params, requests[0].prompt_token_ids
        samples = [
            SampleState(
                r.request_id,
                i,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                params.logprobs is not None,
            )
            for i, r in enumerate(requests)
        ]
        group = GroupState(requests[0].group_id, prompt, prompt_token_ids, output_kind, samples)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
            group.prompt_logprobs_ready = len(prompt_token_ids) <= 1
        return group

    def add(self, group: GroupState) -> None:
        self.groups[group.group_id] = group
        for sample in group.samples:
            self._samples[sample.request_id] = (group, sample)

    def abort(self, group_id: str) -> list[str]:
        """Forget a group; returns its unfinished request ids for the scheduler to stop."""
        group = self.groups.pop(group_id, None)
        if group is None:
            return []
        for sample in group.samples:
            self._samples.pop(sample.request_id, None)
        return [s.request_id for s in group.samples if not s.finished]

    def process(self, core_outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[Stop]]:
        """Apply one step's core outputs; the RequestOutputs to report and the requests to stop.

        A failure while detokenizing one sequence stops that sequence alone, with "error".
        """
        now = time.perf_counter()
        touched: dict[str, GroupState] = {}
        stops: list[Stop] = []
        for core in core_outputs:
            entry = self._samples.get(core.request_id)
            if entry is None:
                continue  # aborted meanwhile
            group, sample = entry
            touched[group.group_id] = group
            group.num_cached_tokens = core.num_cached_tokens
            group.cache_miss_reason = core.cache_miss_reason or group.cache_miss_reason
            group.embedding = core.embedding or group.embedding
            if core.prompt_logprobs is not None and group.prompt_logprobs is not None:
                start, entries = core.prompt_logprobs  # a prompt scored again after a preemption: same values
                group.prompt_logprobs[start : start + len(entries)] = entries
                group.prompt_logprobs_ready |= start + len(entries) == len(group.prompt_logprobs)
            try:
                stop = self._apply(sample, core, now)
            except Exception:
                logger.exception("detokenizing request %s failed; stopping it", core.request_id)
                sample.finish_reason, sample.stop_reason = "error", None
                stop = Stop(core.request_id, "error")
            if stop is not None:
                stops.append(stop)
        return [out for group in touched.values() if (out := self._report(group)) is not None], stops

    def _apply(self, sample: SampleState, core: CoreOutput, now: float) -> Stop | None:
        """Feed the new tokens to the detokenizer one by one; a stop string ends the sequence there."""
        if sample.finished:
            return None
        detokenizer = sample.detokenizer
        for j, token in enumerate(core.new_token_ids):
            last = j == len(core.new_token_ids) - 1
            sample.token_ids.append(token)
            if sample.wants_logprobs and core.logprobs is not None:
                sample.logprobs.append(core.logprobs[j])
                sample.top_logprobs.append(core.top_logprobs[j])
            sample.first_token_time = sample.first_token_time or now
            sample.last_token_time = now
            # EOS or a stop id: its text is left out unless include_stop_str_in_output (the detokenizer decides)
            detokenizer.add_token(token, stop_token=last and core.stop_token)
            if detokenizer.stop_reason is not None:
                sample.finish_reason, sample.stop_reason = "stop", detokenizer.stop_reason
                return (
                    None
                    if last and core.finish_reason is not None
                    else Stop(sample.request_id, "stop", detokenizer.stop_reason)
                )
        if core.finish_reason is not None:
            detokenizer.finish()
            sample.finish_reason, sample.stop_reason = core.finish_reason, core.stop_reason
        return None

    def _report(self, group: GroupState) -> RequestOutput | None:
        finished = group.finished
        if not finished and group.output_kind is OutputKind.FINAL_ONLY:
            return None
        output = _build_output(group)
        if finished:
            self.abort(group.group_id)  # forgets it; no sample is left to stop
        return output


def _completion_output(sample: SampleState, delta: bool) -> CompletionOutput:
    """Snapshot one sample, with what is new since the previous snapshot as the delta.

    With OutputKind.DELTA the snapshot holds only the new part (text == delta_text), so a stream's outputs
    add up to O(output) bytes instead of O(output^2).
    """
    text = sample.detokenizer.output_text
    start_text, start_tokens = sample.emitted_text, sample.emitted_tokens
    delta_text, delta_tokens = text[start_text:], sample.token_ids[start_tokens:]
    sample.emitted_text, sample.emitted_tokens = len(text), len(sample.token_ids)
    logprobs = top_logprobs = None
    if sample.wants_logprobs:
        first = start_tokens if delta else 0
        logprobs, top_logprobs = sample.logprobs[first:], sample.top_logprobs[first:]
    return CompletionOutput(
        index=sample.index,
        text=delta_text if delta else text,
        token_ids=delta_tokens if delta else list(sample.token_ids),
        delta_text=delta_text,
        delta_token_ids=delta_tokens,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _build_output(group: GroupState) -> RequestOutput:
    first = group.samples[0]
    ttft = (first.first_token_time - group.arrival_time) if first.first_token_time else 0.0
    delta = group.output_kind is OutputKind.DELTA
    return RequestOutput(
        request_id=group.group_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=[_completion_output(s, delta) for s in group.samples],
        num_cached_tokens=group.num_cached_tokens,
        finished=group.finished,
        metrics={"arrival_time": group.arrival_time, "ttft": ttft, "last_token_time": first.last_token_time or 0.0},
        error=INTERNAL_ERROR if any(s.finish_reason == "error" for s in group.samples) else None,
        prompt_logprobs=group.prompt_logprobs if group.prompt_logprobs_ready else None,
        cache_miss_reason=group.cache_miss_reason,
        embedding=group.embedding,
    )
