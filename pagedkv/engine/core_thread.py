"""EngineThread: the one thread that may touch the engine's core and output processor; it runs the loop.

Neither the core (scheduler, KV cache, runner, sampler) nor the output processor is thread-safe, so
everything that reads or changes them -- adding requests, stepping, aborting -- runs here, through the
same ``EngineLoop`` the offline ``LLM`` drives. Requests arrive tokenized, validated and built (on the
TokenizerWorker, so a huge prompt never stalls the loop). Other threads hand commands over through a
deque; between steps the thread drains them, then runs one step of the loop and posts its
RequestOutputs to the event loop. With nothing to do it sleeps on an Event instead of spinning. After
every step it publishes a ``stats()`` snapshot, so ``/metrics`` never calls the engine.

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

from pagedkv.engine.request import INTERNAL_ERROR, OutputKind, Request, RequestOutput

if TYPE_CHECKING:
    from pagedkv.engine.core import EngineCore
    from pagedkv.engine.loop import EngineLoop

logger = logging.getLogger(__name__)


class EngineStopped(Exception):
    """The engine is shutting down or its thread died: the request cannot finish (a 503)."""


class RequestFailed(Exception):
    """The engine stopped this request on an internal error (a 500); the message is safe to show."""


@dataclass(slots=True)
class AddCommand:
    """Queue all prompts of one API request, all or none; ``future`` gets None or the error."""

    requests: list[list[Request]]
    prompts: list[str | None]
    output_kind: OutputKind
    future: asyncio.Future


@dataclass(slots=True)
class InspectCommand:
    """Run ``read(core)`` between two steps, where the core's state is whole (the KV map's snapshot);
    ``future`` gets its result or its error."""

    read: Callable[[EngineCore], object]
    future: asyncio.Future


@dataclass(slots=True)
class AbortCommand:
    """Stop these request groups (one per prompt) and forget their output state."""

    group_ids: list[str]


class EngineThread:
    """Runs ``engine``'s loop. On this thread: ``publish_stats(snapshot)`` after each step and whenever it
    goes idle. On ``loop``: ``on_outputs(outputs)`` after each step that reported any,
    ``on_failure(group_ids, error)`` when requests were stopped without an output, ``on_death(error)`` once
    if the thread dies."""

    def __init__(
        self,
        engine: EngineLoop,
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
        self._commands: deque[AddCommand | AbortCommand | InspectCommand] = deque()
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

    def submit(self, command: AddCommand | AbortCommand | InspectCommand) -> None:
        with self._lock:
            if not self._dead:
                self._commands.append(command)
                self._wake.set()
                return
        if isinstance(command, (AddCommand, InspectCommand)):
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
                self.submit(command)  # refused now that the thread is dead: its future gets EngineStopped
            self._post(self._on_death, EngineStopped(f"the engine thread died ({type(exc).__name__})"))

    def _serve(self) -> None:
        while True:
            while self._commands:
                self._apply(self._commands.popleft())
            if self._stopping:
                self._abort_all()
                return
            if not self.engine.core.has_unfinished_requests():
                self._publish_stats(self.engine.core.stats())
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                # The core stops a failing request (or a failing model step's requests) itself, the processor
                # a failing detokenization; an exception that still escapes means their state cannot be
                # trusted: stop everything live.
                failed = self._abort_all()
                logger.exception("engine step failed; aborted %d requests", len(failed))
                self._post(self._on_failure, failed, RequestFailed(INTERNAL_ERROR))
                continue
            if outputs:
                self._post(self._on_outputs, outputs)
            self._publish_stats(self.engine.core.stats())

    def _abort_all(self) -> list[str]:
        """Abort every live request group; their ids."""
        group_ids = self.engine.abort_all()
        self._publish_stats(self.engine.core.stats())
        return group_ids

    def _apply(self, command: AddCommand | AbortCommand | InspectCommand) -> None:
        if isinstance(command, AbortCommand):
            for group_id in command.group_ids:
                self.engine.abort(group_id)
            return
        if isinstance(command, InspectCommand):
            try:
                result, error = command.read(self.engine.core), None
            except Exception as exc:  # a reader's bug fails its caller, never the engine
                logger.exception("inspecting the engine failed")
                result, error = None, exc
            self._post(_settle, command.future, error, result)
            return
        try:
            self.engine.add(command.requests, command.prompts, command.output_kind)
        except Exception:
            logger.exception("adding requests failed")
            self._post(_settle, command.future, RequestFailed(INTERNAL_ERROR))
            return
        self._post(_settle, command.future, None)


def _settle(future: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    if future.done():  # the waiting handler was cancelled; it sent an abort for these requests
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
