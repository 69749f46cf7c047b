"""EngineLoop: step -> process -> stop, the one loop that the offline ``LLM`` and the server both drive.

One ``step()``: ``EngineCore.step`` (schedule, run the model, sample, advance: token ids) ->
``OutputProcessor.process`` (detokenize, stop strings, the callers' RequestOutputs) -> the requests whose
stop string completed are finished in the core at once, so no later step computes tokens nobody reads.
It keeps the core's registry and the processor's in step (a group enters both or neither; an abort takes
it out of both). ``LLMEngine`` runs it on the caller's thread, the server on its engine thread (``core_thread``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.core import EngineCore
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.request import OutputKind, Request, RequestOutput


class EngineLoop:
    def __init__(self, core: EngineCore, processor: OutputProcessor) -> None:
        self.core = core
        self.processor = processor

    def add(self, requests: Sequence[list[Request]], prompts: Sequence[str | None], output_kind: OutputKind) -> None:
        """Give each prompt's built requests (``LLMEngine.make_requests``) their output state and queue them, all
        prompts or none (the server adds all prompts of one API request at once)."""
        added: list[str] = []
        try:
            for prompt_requests, prompt in zip(requests, prompts, strict=True):
                self.processor.add(self.processor.make_group(prompt_requests, prompt, output_kind))
                added.append(prompt_requests[0].group_id)
                self.core.add(prompt_requests)
        except BaseException:
            for group_id in added:
                self.abort(group_id)
            raise

    def abort(self, group_id: str) -> bool:
        """Stop a request group now and give its blocks back. False if it is unknown or already done."""
        if group_id not in self.processor.groups:
            return False
        self.core.finish(self.processor.abort(group_id), "abort")
        return True

    def abort_all(self) -> list[str]:
        """Abort every live group, in the processor or still in the core; their ids."""
        live = list(self.core.scheduler.requests.values())
        group_ids = list(dict.fromkeys([*self.processor.groups, *(r.group_id for r in live)]))
        for group_id in group_ids:
            self.processor.abort(group_id)
        self.core.finish([r.request_id for r in live], "abort")
        return group_ids

    def step(self) -> list[RequestOutput]:
        """Run one engine step; an output for every request group that made progress (per its OutputKind)."""
        outputs, stops = self.processor.process(self.core.step())
        for stop in stops:
            self.core.finish([stop.request_id], stop.reason, stop.stop_reason)
        return outputs
