"""GrammarPool: the server's own threads for compiling structured-output grammars, with a time limit.

Grammars used to compile on the TokenizerWorker, the one thread that also detokenizes every stream's
tokens: eight distinct ~55 KB schemas froze another client's stream for 11-24 s. Now a request's grammar is
compiled and probed here, before the worker builds the request (which then only copies the compiled
matcher, see ``GrammarCompiler.holding``), so stream delivery never waits on a compile.

Threads, not a process: llguidance drops the GIL while it builds a grammar and while it computes a mask
(measured: a Python thread spinning next to four 55 KB compiles kept 90 % of its iterations, its longest
pause 8 ms), and a compiled matcher cannot leave its process. The pool is small and fixed
(``COMPILE_THREADS``): on a machine whose cores run the model, compiles must not crowd out the engine.

Each request waits at most ``COMPILE_TIMEOUT_S`` for its compile to start (else a 503: the pool is busy,
retry) and at most ``COMPILE_TIMEOUT_S`` for it to finish once started (else a 400 naming the field and the
limit: the spec is too complex). A compile cannot be interrupted; one that overran still finishes and is
cached, so the same spec again is answered at once, and a compile nobody waits for any more is dropped from
the queue before it starts.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedkv.errors import InvalidParameter
from pagedkv.structured import GrammarCompiler, StructuredOutputsParams

COMPILE_THREADS = 1
COMPILE_TIMEOUT_S = 10.0


class GrammarsBusy(Exception):
    """The compile did not start within the time limit: every compile thread was busy (retry later)."""


class GrammarPool:
    def __init__(
        self, compiler: GrammarCompiler, threads: int = COMPILE_THREADS, timeout_s: float = COMPILE_TIMEOUT_S
    ) -> None:
        if threads < 1 or not timeout_s > 0:
            raise ValueError(f"a grammar pool needs threads >= 1 and timeout_s > 0, got {threads}, {timeout_s}")
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagedkv-grammar")

    async def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled, probed template for ``params``. Raises InvalidParameter (a 400: it does not compile,
        fails its probe, or took longer than the limit) or GrammarsBusy (a 503)."""
        started: list[float] = []

        def job() -> Any:
            started.append(time.monotonic())
            return self.compiler.compile(params)

        future = self._pool.submit(job)
        waited = asyncio.wrap_future(future)
        waited.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody waits
        try:
            done, _ = await asyncio.wait({waited}, timeout=self.timeout_s)
            if not done and future.cancel():
                raise GrammarsBusy(
                    f"the grammar compiler is busy: this request's structured output waited {self.timeout_s:g} s "
                    "for a compile thread; retry later"
                )
            if not done:  # running: it gets the whole limit from its start
                began = started[0] if started else time.monotonic()  # running, but its first line not yet run
                left = began + self.timeout_s - time.monotonic()
                done, _ = await asyncio.wait({waited}, timeout=max(left, 0.0))
            if not done:
                raise InvalidParameter(
                    "structured_outputs",
                    f"structured_outputs.{params.kind} did not compile within the limit of {self.timeout_s:g} s "
                    "(the grammar compile time limit): simplify it",
                )
        except asyncio.CancelledError:  # the client went away: a compile not yet started is not needed
            future.cancel()
            raise
        return waited.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
