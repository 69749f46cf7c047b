"""AsyncEngine: the event-loop side of the server's engine -- admission, per-request streams, metrics.

Three threads, each with one job. Handlers ``await add(...)`` on the event loop; the TokenizerWorker
tokenizes the prompts and builds the requests; the EngineThread runs the engine loop (``EngineLoop``, the
one ``LLM`` runs too: core step, output processor, stop strings) and posts each step's RequestOutputs to
``_deliver`` here, which routes them to their streams. Requests of all clients share the engine, so they
are batched together for free. The routing table, the streams and the metrics are touched only on the
loop, so none of it needs a lock.

Streams carry deltas (``pagedkv.engine.request_stream``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from pagedkv.engine.core_thread import (
    AbortCommand,
    AddCommand,
    EngineStopped,
    EngineThread,
    InspectCommand,
    RequestFailed,
)
from pagedkv.engine.grammar_pool import GrammarPool
from pagedkv.engine.metrics import ServerMetrics
from pagedkv.engine.prompts import EnginePrompt
from pagedkv.engine.request import OutputKind, RequestOutput
from pagedkv.engine.request_stream import RequestStream
from pagedkv.engine.tokenizer_worker import TokenizerWorker
from pagedkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.config import EngineConfig
    from pagedkv.engine.core import EngineCore
    from pagedkv.engine.engine import LLMEngine

T = TypeVar("T")

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncEngine",
    "EngineOverloaded",
    "EnginePrompt",
    "EngineStopped",
    "RequestFailed",
    "RequestStream",
    "load_engine",
]


def load_engine(config: EngineConfig) -> LLMEngine:
    """Build the LLMEngine an AsyncEngine will run, on a short-lived thread of its own.

    Why not on the caller's thread: the engine thread runs every step, and torch's intra-op threads (libgomp)
    keep a pool of workers for each thread that ever ran a parallel region. Loading packs the weights with
    parallel torch ops; done on the server's main thread, which lives on, that thread's pool stayed next to
    the engine thread's, and every 2-thread step ran ~40 % slower (one request at a time, SmolLM2 gguf, AMD
    EPYC Zen 5: 40-47 tokens/s against 74-78 when the loading thread had exited; 1 thread: no difference).
    A thread's pool goes away with it.
    """
    from pagedkv.engine.engine import LLMEngine

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-load") as loader:
        return loader.submit(LLMEngine, config).result()


class EngineOverloaded(Exception):
    """More sequences queued or running than ``max_queued_seqs`` allows."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, max_queued_seqs: int | None = None, grammars: GrammarPool | None = None
    ) -> None:
        self.engine = engine
        self.max_queued_seqs = max_queued_seqs
        self.metrics = ServerMetrics(self.stats)
        self.tokenizer = TokenizerWorker(engine, grammars)
        self.failed = False  # the engine thread died: the server must exit (non-zero) to be restarted
        self._thread: EngineThread | None = None
        self._accepting = False
        self._routes: dict[str, tuple[RequestStream, int]] = {}  # the client's one registry of live requests
        self._num_sequences = 0
        self._stats = engine.stats()  # the one snapshot: replaced by the engine thread after every step

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        loop = asyncio.get_running_loop()
        self._thread = EngineThread(self.engine.loop, loop, self._deliver, self._fail, self._died, self._set_stats)
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
        self._thread = None
        self.tokenizer.close()
        self._fail(list(self._routes), EngineStopped("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._accepting and self._thread is not None and self._thread.is_running

    @property
    def num_in_flight(self) -> int:
        """Engine requests (one per prompt) queued or running."""
        return len(self._routes)

    @property
    def num_sequences(self) -> int:
        """Sequences (each prompt's n samples) queued or running: what admission counts."""
        return self._num_sequences

    def stats(self) -> dict[str, float]:
        """The engine's counters as of its latest step."""
        return dict(self._stats)

    def _set_stats(self, stats: dict[str, float]) -> None:
        self._stats = stats

    async def inspect(self, read: Callable[[EngineCore], T]) -> T:
        """``read(core)``, run on the engine thread between two steps (the only place the core's state is
        whole); raises EngineStopped if the engine is not running, or what ``read`` raised."""
        thread = self._thread
        if thread is None or not thread.is_running:
            raise EngineStopped("the engine is not running")
        future = asyncio.get_running_loop().create_future()
        thread.submit(InspectCommand(read, future))
        return await future

    async def add(
        self,
        request_id: str,
        prompts: list[EnginePrompt],
        params: SamplingParams,
        cache_salt: str | None = None,
        stream: bool = False,
    ) -> RequestStream:
        """Tokenize all prompts of one API request and queue them, once the engine thread accepted them.

        Raises ValueError (bad input; nothing was queued), EngineOverloaded, EngineStopped or RequestFailed.
        """
        sequences = len(prompts) * params.n
        self._admit(sequences)
        group_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        requests = await self.tokenizer.prepare(group_ids, prompts, params, cache_salt)
        self._admit(sequences)  # preparing took time: look again before queueing
        request = RequestStream(self, request_id, group_ids, requests)
        for index, engine_id in enumerate(request.engine_ids):
            self._routes[engine_id] = (request, index)
        self._num_sequences += sequences
        future = asyncio.get_running_loop().create_future()
        self._thread.submit(AddCommand(requests, [p.prompt for p in prompts], kind, future))
        try:
            await future
        except asyncio.CancelledError:
            self._abort(request)  # the add may have happened already; the abort follows it in order
            raise
        except BaseException:
            self._stop(request)
            raise
        self.metrics.prompt_tokens.inc(request.prompt_tokens)
        return request

    def _admit(self, sequences: int) -> None:
        if not self.is_running:
            raise EngineStopped("the server is shutting down" if not self.failed else "the engine is not running")
        limit = self.max_queued_seqs
        if limit is not None and self._num_sequences + sequences > limit:
            raise EngineOverloaded(
                f"{self._num_sequences} sequences are queued or running, this request adds {sequences} "
                f"(n x prompts) and the limit is {limit} (--max-queued-seqs): retry later"
            )

    def _forget(self, stream: RequestStream, indices: list[int]) -> None:
        """Drop these prompts of ``stream`` from the routing table and the sequence count."""
        for index in indices:
            if index in stream.unfinished:
                del self._routes[stream.engine_ids[index]]
                stream.unfinished.discard(index)
                self._num_sequences -= stream.n

    def _stop(self, stream: RequestStream) -> None:
        """Stop the unfinished prompts of ``stream`` in the routing table and on the engine thread."""
        indices = sorted(stream.unfinished)
        self._forget(stream, indices)
        if indices and self._thread is not None:
            self._thread.submit(AbortCommand([stream.engine_ids[i] for i in indices]))

    def _abort(self, stream: RequestStream) -> None:
        if stream.finished:
            return
        self.metrics.requests.labels(finish_reason="abort").inc(len(stream.unfinished) * stream.n)
        self._stop(stream)
        stream.aborted = True
        stream.close()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route one step's outputs to their streams."""
        now = time.perf_counter()
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue  # aborted while this step ran
            stream, index = route
            self._observe(stream, index, output, now)
            if output.error is not None:  # the engine stopped it: the API request fails as a whole
                self._forget(stream, [index])
                self._stop(stream)
                stream.close(RequestFailed(output.error))
                continue
            stream.push(index, output)
            if output.finished:
                self._forget(stream, [index])
                if stream.finished:
                    stream.close()

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
        """End the streams of these engine requests (stopped by the engine thread) with ``error``."""
        for engine_id in engine_ids:
            route = self._routes.get(engine_id)
            if route is None:
                continue
            stream, index = route
            self.metrics.requests.labels(finish_reason="abort").inc(stream.n)
            self._forget(stream, [index])
            if stream.finished:
                stream.close(error)

    def _died(self, error: BaseException) -> None:
        """The engine thread is gone: fail every stream; ``failed`` tells the server to exit so it is restarted."""
        self.failed = True
        self._accepting = False
        self._fail(list(self._routes), error)
