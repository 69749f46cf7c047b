"""EngineThread: the one thread that may touch the LLMEngine.

LLMEngine is not thread-safe, so everything that reads or changes it -- ``add_request``, ``step``,
``abort``, and the tokenizer's encode / chat template -- runs here. Other threads hand it commands through
a deque; between steps the thread drains them, then runs one step and passes the whole step's outputs to
the event loop in a single ``call_soon_threadsafe``. With nothing to do it sleeps on an Event instead of
spinning. After every step it publishes a ``stats()`` snapshot, so ``/metrics`` never calls the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.engine.request import RequestOutput
from pagedkv.sampling import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineStopped(Exception):
    """The engine is shutting down or failed: the request cannot finish."""


@dataclass(slots=True)
class EnginePrompt:
    """One prompt as text, token ids, or chat messages (tokenized on the engine thread)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(slots=True)
class AddCommand:
    """Add prompts as engine requests, all or none; ``future`` gets their prompt lengths or the error."""

    engine_ids: list[str]
    prompts: list[EnginePrompt]
    params: SamplingParams
    cache_salt: str | None
    future: asyncio.Future


@dataclass(slots=True)
class AbortCommand:
    engine_ids: list[str]


class EngineThread:
    """Runs the engine; ``on_outputs(outputs)`` and ``on_failure(engine_ids, error)`` run on ``loop``."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_failure: Callable[[list[str], BaseException], None],
    ) -> None:
        self.engine = engine
        self.stats: dict[str, float] = engine.stats()
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._commands: deque[AddCommand | AbortCommand] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._live: set[str] = set()  # engine requests added and not yet finished; engine thread only
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, command: AddCommand | AbortCommand) -> None:
        self._commands.append(command)
        self._wake.set()

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
        while True:
            while self._commands:
                self._apply(self._commands.popleft())
            if self._stopping:
                self._abort_all()
                return
            if not self.engine.has_unfinished_requests():
                self.stats = self.engine.stats()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                logger.exception("engine step failed; aborting %d requests", len(self._live))
                failed = list(self._live)
                self._abort_all()
                self._post(self._on_failure, failed, EngineStopped(f"the engine failed: {exc}"))
                continue
            for output in outputs:
                if output.finished:
                    self._live.discard(output.request_id)
            if outputs:
                self._post(self._on_outputs, outputs)
            self.stats = self.engine.stats()

    def _abort_all(self) -> None:
        for engine_id in self._live:
            self.engine.abort(engine_id)
        self._live.clear()
        self.stats = self.engine.stats()

    def _apply(self, command: AddCommand | AbortCommand) -> None:
        if isinstance(command, AbortCommand):
            for engine_id in command.engine_ids:
                if engine_id in self._live:
                    self._live.discard(engine_id)
                    self.engine.abort(engine_id)
            return
        added: list[str] = []
        prompt_lens: list[int] = []
        try:
            for engine_id, prompt in zip(command.engine_ids, command.prompts, strict=True):
                token_ids = self._tokenize(prompt)
                self.engine.add_request(
                    engine_id,
                    prompt=prompt.prompt,
                    params=command.params,
                    prompt_token_ids=token_ids,
                    cache_salt=command.cache_salt,
                )
                added.append(engine_id)
                prompt_lens.append(len(token_ids))
        except Exception as exc:
            for engine_id in added:
                self.engine.abort(engine_id)
            self._post(_settle, command.future, None, exc)
            return
        self._live.update(added)
        self._post(_settle, command.future, prompt_lens, None)

    def _tokenize(self, prompt: EnginePrompt) -> list[int]:
        if prompt.prompt_token_ids is not None:
            return list(prompt.prompt_token_ids)
        if prompt.messages is not None:
            try:
                return self.engine.apply_chat_template(prompt.messages)
            except Exception as exc:
                raise ValueError(f"messages could not be rendered with the model's chat template: {exc}") from exc
        if prompt.prompt is None:
            raise ValueError("give a prompt, prompt token ids, or messages")
        return self.engine.encode(prompt.prompt)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # the waiting handler was cancelled; it sent an abort for these requests
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
