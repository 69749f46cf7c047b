"""RequestStream: the outputs of one API request, as its handler reads them.

A stream holds at most one unread output per prompt: a new delta is merged into the one its reader has
not taken yet. So a client that reads slowly costs memory in proportion to the text it has not read, never
a queue of copies that grows with every step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pagedkv.engine.request import CompletionOutput, Request, RequestOutput

if TYPE_CHECKING:
    from pagedkv.engine.async_client import AsyncEngine


class RequestStream:
    """The outputs of one API request (one engine request per prompt), as ``(prompt_index, output)``.

    Iteration ends when every prompt has finished or the stream was aborted, and raises EngineStopped or
    RequestFailed if the server shut down or the engine failed the request first. ``stream=True`` streams
    get deltas; others get each prompt's final output only.
    """

    def __init__(
        self, owner: AsyncEngine, request_id: str, group_ids: list[str], requests: list[list[Request]]
    ) -> None:
        self.request_id = request_id
        self.engine_ids = group_ids  # one per prompt: the RequestOutput's request_id
        self.n = len(requests[0])
        prompt_lens = [prompt[0].num_prompt_tokens for prompt in requests]
        self.prompt_tokens = sum(prompt_lens)
        self.completion_tokens = 0
        self.cached_tokens: dict[int, int] = {}
        self.cache_miss_reasons: dict[int, str | None] = {}
        self.unfinished = set(range(len(prompt_lens)))
        self.aborted = False
        self.start_time = time.perf_counter()
        self.last_token_time: list[float | None] = [None] * len(prompt_lens)
        self._pending: dict[int, RequestOutput] = {}
        self._ready = asyncio.Event()
        self._closed = False
        self._error: BaseException | None = None
        self._owner = owner

    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while True:
            if self._pending:
                index = next(iter(self._pending))
                yield index, self._pending.pop(index)
            elif self._closed:
                if self._error is not None:
                    raise self._error
                return
            else:
                self._ready.clear()
                await self._ready.wait()

    def push(self, index: int, output: RequestOutput) -> None:
        """Hand an output to the reader, merged into the one it has not taken yet (if any)."""
        self.completion_tokens += sum(len(sample.delta_token_ids) for sample in output.outputs)
        self.cached_tokens[index] = output.num_cached_tokens
        self.cache_miss_reasons[index] = output.cache_miss_reason
        pending = self._pending.get(index)
        if pending is None:
            self._pending[index] = output
        else:
            _merge_delta(pending, output)
        self._ready.set()

    def close(self, error: BaseException | None = None) -> None:
        if not self._closed:
            self._closed, self._error = True, error
            self._ready.set()

    def abort(self) -> None:
        """Stop generating and free the KV blocks; a no-op once every prompt has finished."""
        self._owner._abort(self)


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append the delta ``new`` to the unread delta ``into`` (in place: ``into`` belongs to the stream)."""
    for a, b in zip(into.outputs, new.outputs, strict=True):
        _merge_sample(a, b)
    into.finished, into.num_cached_tokens, into.error = new.finished, new.num_cached_tokens, new.error
    into.cache_miss_reason = new.cache_miss_reason
    into.metrics = new.metrics
    into.prompt_logprobs = new.prompt_logprobs or into.prompt_logprobs


def _merge_sample(a: CompletionOutput, b: CompletionOutput) -> None:
    a.text = a.delta_text = a.delta_text + b.delta_text
    a.token_ids = a.delta_token_ids = a.delta_token_ids + b.delta_token_ids
    if b.logprobs is not None:
        a.logprobs = (a.logprobs or []) + b.logprobs
        a.top_logprobs = (a.top_logprobs or []) + (b.top_logprobs or [])
    a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
