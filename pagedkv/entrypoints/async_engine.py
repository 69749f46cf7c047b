"""AsyncEngine: the event-loop side of the server's engine -- admission, per-request streams, metrics.

Handlers ``await add(...)`` to queue an API request's prompts and get a RequestStream back; the
EngineThread runs the engine and hands each step's outputs to ``_deliver``, which routes them to the
streams' asyncio queues. Requests of all clients share the engine, so they are batched together for free.
The routing table, the streams and the metrics are touched only on the loop, so none of it needs a lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pagedkv.engine.request import RequestOutput
from pagedkv.entrypoints.engine_thread import (
    AbortCommand,
    AddCommand,
    EnginePrompt,
    EngineStopped,
    EngineThread,
)
from pagedkv.entrypoints.server_metrics import ServerMetrics
from pagedkv.sampling import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineOverloaded", "EnginePrompt", "EngineStopped", "RequestStream"]


class EngineOverloaded(Exception):
    """More requests queued or running than ``max_queued_requests`` allows."""


class RequestStream:
    """The outputs of one API request (one engine request per prompt), as ``(prompt_index, output)``.

    Iteration ends when every prompt has finished or the stream was aborted, and raises EngineStopped
    if the server shut down or the engine failed first.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, num_prompts: int, n: int) -> None:
        self.request_id = request_id
        self.engine_ids = [f"{request_id}-{i}" for i in range(num_prompts)]
        self.n = n
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        self.unfinished = set(range(num_prompts))
        self.aborted = False
        self.start_time = time.perf_counter()
        self.last_token_time: list[float | None] = [None] * num_prompts
        self._owner = owner

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while (item := await self.queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def abort(self) -> None:
        """Stop generating and free the KV blocks; a no-op once every prompt has finished."""
        self._owner._abort(self)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.metrics = ServerMetrics(self.stats)
        self._thread: EngineThread | None = None
        self._accepting = False
        self._routes: dict[str, tuple[RequestStream, int]] = {}
        self._idle_stats = engine.stats()

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._thread = EngineThread(self.engine, asyncio.get_running_loop(), self._deliver, self._fail)
        self._thread.start()
        self._accepting = True

    async def shutdown(self, drain_s: float = 0.0, timeout_s: float = 30.0) -> None:
        """Refuse new requests, give those in flight up to ``drain_s`` to finish, abort the rest, stop the
        engine thread, and end every open stream with EngineStopped."""
        if self._thread is None:
            return
        self._accepting = False
        deadline = time.monotonic() + drain_s
        while self._routes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not await asyncio.to_thread(self._thread.stop, timeout_s):
            logger.warning("the engine thread did not stop within %.0f s", timeout_s)
        self._idle_stats = self._thread.stats
        self._thread = None
        self._fail(list(self._routes), EngineStopped("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_running

    @property
    def num_in_flight(self) -> int:
        """Engine requests (one per prompt) queued or running."""
        return len(self._routes)

    def stats(self) -> dict[str, float]:
        """The engine's counters as of its latest step."""
        return dict(self._thread.stats if self._thread is not None else self._idle_stats)

    async def add(
        self,
        request_id: str,
        prompts: list[EnginePrompt],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue all prompts of one API request, once the engine thread accepted them.

        Raises ValueError (bad input; nothing was queued), EngineOverloaded, or EngineStopped.
        """
        if not self.is_running:
            raise EngineStopped("the server is shutting down")
        limit = self.max_queued_requests
        if limit is not None and self.num_in_flight + len(prompts) > limit:
            raise EngineOverloaded(
                f"{self.num_in_flight} requests are queued or running and the limit is {limit}: retry later"
            )
        stream = RequestStream(self, request_id, len(prompts), params.n)
        for index, engine_id in enumerate(stream.engine_ids):
            self._routes[engine_id] = (stream, index)
        future = asyncio.get_running_loop().create_future()
        self._thread.submit(AddCommand(stream.engine_ids, prompts, params, cache_salt, future))
        try:
            prompt_lens: list[int] = await future
        except asyncio.CancelledError:
            self._abort(stream)  # the add may have happened already; the abort follows it in order
            raise
        except BaseException:
            for engine_id in stream.engine_ids:
                del self._routes[engine_id]
            stream.unfinished.clear()
            raise
        self.metrics.prompt_tokens.inc(sum(prompt_lens))
        return stream

    def _abort(self, stream: RequestStream) -> None:
        if stream.finished:
            return
        engine_ids = [stream.engine_ids[i] for i in sorted(stream.unfinished)]
        for engine_id in engine_ids:
            del self._routes[engine_id]
        self.metrics.requests.labels(finish_reason="abort").inc(len(engine_ids) * stream.n)
        stream.unfinished.clear()
        stream.aborted = True
        stream.queue.put_nowait(None)
        if self._thread is not None:
            self._thread.submit(AbortCommand(engine_ids))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route one step's outputs to their streams."""
        now = time.perf_counter()
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue  # aborted while this step ran
            stream, index = route
            self._observe(stream, index, output, now)
            stream.queue.put_nowait((index, output))
            if output.finished:
                del self._routes[output.request_id]
                stream.unfinished.discard(index)
                if stream.finished:
                    stream.queue.put_nowait(None)

    def _observe(self, stream: RequestStream, index: int, output: RequestOutput, now: float) -> None:
        """Latencies as the client sees them: from arrival at the server, not at the engine."""
        if any(sample.delta_token_ids for sample in output.outputs):
            last = stream.last_token_time[index]
            if last is None:
                self.metrics.ttft.observe(now - stream.start_time)
            else:
                self.metrics.itl.observe(now - last)
            stream.last_token_time[index] = now
        if output.finished:
            for sample in output.outputs:
                self.metrics.requests.labels(finish_reason=sample.finish_reason or "abort").inc()

    def _fail(self, engine_ids: list[str], error: BaseException) -> None:
        """End the streams of these engine requests with ``error``."""
        for engine_id in engine_ids:
            route = self._routes.pop(engine_id, None)
            if route is None:
                continue
            stream, index = route
            self.metrics.requests.labels(finish_reason="abort").inc(stream.n)
            stream.unfinished.discard(index)
            if stream.finished:
                stream.queue.put_nowait(error)
