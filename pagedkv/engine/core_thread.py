"""EngineThread: the one thread that may touch the LLMEngine, and it does nothing but step it.

LLMEngine is not thread-safe, so everything that reads or changes it -- ``add_request``, ``step``, ``abort``
-- runs here. Prompts arrive already tokenized (the TokenizerWorker does that), so a huge prompt never stalls
the step loop. Other threads hand commands over through a deque; between steps the thread drains them,
then runs one step and passes the whole step's outputs to the event loop in one ``call_soon_threadsafe``.
With nothing to do it sleeps on an Event instead of spinning. After every step it publishes a ``stats()``
snapshot, so ``/metrics`` never calls the engine.

Supervision: if the thread dies of anything (a ``BaseException`` included), it reports the death once, and
every command still queued or submitted later has its future settled with EngineStopped -- nobody waits
forever on a thread that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.engine.request import INTERNAL_ERROR, OutputKind, RequestOutput
from pagedkv.sampling import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineStopped(Exception):
    """The engine is shutting down or its thread died: the request cannot finish (a 503)."""


class RequestFailed(Exception):
    """The engine stopped this request on an internal error (a 500); the message is safe to show."""


@dataclass(slots=True)
class AddCommand:
    """Add tokenized prompts as engine requests, all or none; ``future`` gets None or the error."""

    engine_ids: list[str]
    token_lists: list[list[int]]
    params: SamplingParams
    cache_salt: str | None
    output_kind: OutputKind
    future: asyncio.Future


@dataclass(slots=True)
class AbortCommand:
    engine_ids: list[str]


class EngineThread:
    """Runs the engine. On ``loop``: ``on_outputs(outputs)`` after each step, ``on_failure(engine_ids, error)``
    when requests were stopped without an output, ``on_death(error)`` once if the thread dies. On this
    thread: ``publish_stats(snapshot)`` after each step and whenever it goes idle."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_failure: Callable[[list[str], BaseException], None],
        on_death: Callable[[BaseException], None],
        publish_stats: Callable[[dict[str, float]], None],
    ) -> None:
        self.engine = engine
        self._publish_stats = publish_stats  # called on this thread: a plain assignment, no loop hop
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._on_death = on_death
        self._commands: deque[AddCommand | AbortCommand] = deque()
        self._lock = threading.Lock()  # orders submit() against the thread's death
        self._wake = threading.Event()
        self._stopping = False
        self._dead = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and not self._dead

    def submit(self, command: AddCommand | AbortCommand) -> None:
        with self._lock:
            if not self._dead:
                self._commands.append(command)
                self._wake.set()
                return
        if isinstance(command, AddCommand):
            self._post(_settle, command.future, EngineStopped("the engine is not running"))

    def stop(self, timeout_s: float) -> bool:
        """Abort every live request and end the thread (blocking); False if it did not end in time."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _post(self, callback: Callable, *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            logger.debug("event loop closed; dropped %s", callback)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            logger.critical("the engine thread died; the server can no longer generate", exc_info=True)
            with self._lock:
                self._dead = True
                orphans = list(self._commands)
                self._commands.clear()
            for command in orphans:
                if isinstance(command, AddCommand):
                    self._post(_settle, command.future, EngineStopped("the engine is not running"))
            self._post(self._on_death, EngineStopped(f"the engine thread died ({type(exc).__name__})"))

    def _serve(self) -> None:
        while True:
            while self._commands:
                self._apply(self._commands.popleft())
            if self._stopping:
                self._abort_all()
                return
            if not self.engine.has_unfinished_requests():
                self._publish_stats(self.engine.stats())
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                # The engine stops a failing request (or a failing model step's requests) itself; an
                # exception that still escapes means its state cannot be trusted: stop everything live.
                failed = self._abort_all()
                logger.exception("engine step failed; aborted %d requests", len(failed))
                self._post(self._on_failure, failed, RequestFailed(INTERNAL_ERROR))
                continue
            if outputs:
                self._post(self._on_outputs, outputs)
            self._publish_stats(self.engine.stats())

    def _abort_all(self) -> list[str]:
        """Abort every request the engine holds (the engine's registry is the only one); their ids."""
        live = list(self.engine.processor.groups)
        for engine_id in live:
            self.engine.abort(engine_id)
        self._publish_stats(self.engine.stats())
        return live

    def _apply(self, command: AddCommand | AbortCommand) -> None:
        if isinstance(command, AbortCommand):
            for engine_id in command.engine_ids:
                self.engine.abort(engine_id)  # False (a no-op) if it finished meanwhile
            return
        added: list[str] = []
        try:
            for engine_id, token_ids in zip(command.engine_ids, command.token_lists, strict=True):
                self.engine.add_request(
                    engine_id,
                    params=command.params,
                    prompt_token_ids=token_ids,
                    cache_salt=command.cache_salt,
                    output_kind=command.output_kind,
                )
                added.append(engine_id)
        except Exception as exc:
            for engine_id in added:
                self.engine.abort(engine_id)
            if not isinstance(exc, ValueError):  # bad input is the client's to see; anything else is ours
                logger.exception("adding request %s failed", command.engine_ids[0])
                exc = RequestFailed(INTERNAL_ERROR)
            self._post(_settle, command.future, exc)
            return
        self._post(_settle, command.future, None)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiting handler was cancelled; it sent an abort for these requests
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
