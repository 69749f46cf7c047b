"""EngineThread: the one thread that may touch the EngineCore, and it does nothing but step it.

The core (scheduler, KV cache, runner, sampler) is not thread-safe, so everything that reads or changes
it -- adding requests, stepping, finishing requests -- runs here. Requests arrive tokenized, validated and
built (on the TokenizerWorker), and each step's token-level outputs leave as they are: detokenizing them
happens on the worker too, so a huge prompt or a slow detokenization never stalls the step loop. Other
threads hand commands over through a deque; between steps the thread drains them, then runs one step and
hands its ``CoreOutput``s to ``on_core_outputs``. With nothing to do it sleeps on an Event instead of
spinning. After every step it publishes a ``stats()`` snapshot, so ``/metrics`` never calls the engine.

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

from pagedkv.engine.request import INTERNAL_ERROR, CoreOutput, Request

if TYPE_CHECKING:
    from pagedkv.engine.core import EngineCore

logger = logging.getLogger(__name__)


class EngineStopped(Exception):
    """The engine is shutting down or its thread died: the request cannot finish (a 503)."""


class RequestFailed(Exception):
    """The engine stopped this request on an internal error (a 500); the message is safe to show."""


@dataclass(slots=True)
class AddCommand:
    """Queue built requests (all prompts of one API request); ``future`` gets None or the error."""

    requests: list[Request]
    future: asyncio.Future


@dataclass(slots=True)
class InspectCommand:
    """Run ``read(core)`` between two steps, where the core's state is whole (the KV map's snapshot);
    ``future`` gets its result or its error."""

    read: Callable[[EngineCore], object]
    future: asyncio.Future


@dataclass(slots=True)
class FinishCommand:
    """Stop these core requests: an abort, or a stop string the output processor found."""

    request_ids: list[str]
    reason: str = "abort"
    stop_reason: str | None = None


class EngineThread:
    """Runs the core. On this thread: ``on_core_outputs(outputs)`` after each step and
    ``publish_stats(snapshot)`` after each step and whenever it goes idle. On ``loop``:
    ``on_failure(group_ids, error)`` when requests were stopped without an output, ``on_death(error)`` once
    if the thread dies."""

    def __init__(
        self,
        core: EngineCore,
        loop: asyncio.AbstractEventLoop,
        on_core_outputs: Callable[[list[CoreOutput]], None],
        on_failure: Callable[[list[str], BaseException], None],
        on_death: Callable[[BaseException], None],
        publish_stats: Callable[[dict[str, float]], None],
    ) -> None:
        self.core = core
        self._publish_stats = publish_stats  # called on this thread: a plain assignment, no loop hop
        self._loop = loop
        self._on_core_outputs = on_core_outputs
        self._on_failure = on_failure
        self._on_death = on_death
        self._commands: deque[AddCommand | FinishCommand | InspectCommand] = deque()
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

    def submit(self, command: AddCommand | FinishCommand | InspectCommand) -> None:
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
            if not self.core.has_unfinished_requests():
                self._publish_stats(self.core.stats())
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.core.step()
            except Exception:
                # The core stops a failing request (or a failing model step's requests) itself; an
                # exception that still escapes means its state cannot be trusted: stop everything live.
                failed = self._abort_all()
                logger.exception("engine step failed; aborted %d requests", len(failed))
                self._post(self._on_failure, failed, RequestFailed(INTERNAL_ERROR))
                continue
            if outputs:
                self._on_core_outputs(outputs)
            self._publish_stats(self.core.stats())

    def _abort_all(self) -> list[str]:
        """Abort every request the core holds (its registry is the only one); the API requests' group ids."""
        live = list(self.core.scheduler.requests.values())
        self.core.finish([r.request_id for r in live], "abort")
        self._publish_stats(self.core.stats())
        return list(dict.fromkeys(r.group_id for r in live))

    def _apply(self, command: AddCommand | FinishCommand | InspectCommand) -> None:
        if isinstance(command, FinishCommand):
            self.core.finish(command.request_ids, command.reason, command.stop_reason)
            return
        if isinstance(command, InspectCommand):
            try:
                result, error = command.read(self.core), None
            except Exception as exc:  # a reader's bug fails its caller, never the engine
                logger.exception("inspecting the engine failed")
                result, error = None, exc
            self._post(_settle, command.future, error, result)
            return
        try:
            self.core.add(command.requests)
        except Exception:
            logger.exception("adding requests failed")
            self.core.finish([r.request_id for r in command.requests], "abort")
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
