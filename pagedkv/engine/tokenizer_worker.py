"""TokenizerWorker: the server's one thread for prompts -- text in, built requests out.

The engine thread must only run the engine loop: tokenizing a long prompt there (seconds for megabytes of
text) would stall every stream. The event loop must not do it either, or it would stall every connection.
And a fast (Rust) tokenizer must not be shared across threads: its encode path takes an internal borrow
that a second thread trips over ("Already borrowed"). So this one thread owns a private copy of the
tokenizer: it tokenizes prompts, renders chat templates, and validates and builds the engine requests.
Detokenizing is the engine loop's, with the engine's own tokenizer, on the engine thread.

Logprob responses need every sampled token's text on the event loop; the worker decodes the whole
vocabulary once (a batch decode, ~0.2 s for 49 k tokens) and the loop reads that table.

One kind of work is kept off this thread: compiling a structured output's grammar (seconds for a large
schema, and every stream's delivery would wait behind it). ``prepare`` first awaits the grammar on the
GrammarPool, then builds the requests here from the compiled grammar.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from pagedkv.engine.grammar_pool import GrammarPool, GrammarsBusy
from pagedkv.engine.prompts import EnginePrompt
from pagedkv.engine.request import Request
from pagedkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine

T = TypeVar("T")


class TokenizerWorker:
    def __init__(self, engine: LLMEngine, grammars: GrammarPool | None = None) -> None:
        self._engine = engine  # only its fixed settings are read here (make_requests)
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tokenizer")
        self._token_texts: Future[list[str]] | None = None
        self.grammars = grammars or GrammarPool(engine.grammars)  # compiles off this thread (issue 25 row 3)

    async def prepare(
        self,
        group_ids: list[str],
        prompts: list[EnginePrompt],
        params: SamplingParams,
        cache_salt: str | None,
    ) -> list[list[Request]]:
        """Tokenize, validate and build every prompt's requests, all or none; the requests of each prompt.
        ValueError (a 400) if one cannot be, EngineOverloaded (a 503) if its grammar could not even start
        compiling in time."""
        spec = params.structured_outputs
        try:
            template = None if spec is None else await self.grammars.compile(spec)
        except GrammarsBusy as exc:
            from pagedkv.engine.async_client import EngineOverloaded  # it imports this module

            raise EngineOverloaded(str(exc)) from exc

        def build() -> list[list[Request]]:  # on the worker
            with self._engine.grammars.holding(spec, template):  # copies of the compiled grammar, no compile
                return [
                    self._engine.make_requests(group_id, prompt.token_ids(self._tokenizer), params, cache_salt)
                    for group_id, prompt in zip(group_ids, prompts, strict=True)
                ]

        return await asyncio.wrap_future(self._pool.submit(build))

    async def token_texts(self) -> list[str]:
        """Each token id's text (skip_special_tokens=False, no clean-up), decoded once on first use."""
        if self._token_texts is None:
            self._token_texts = self._pool.submit(self._decode_vocabulary)
        return await asyncio.wrap_future(self._token_texts)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of these ids (special tokens kept, no clean-up): what echo gives back for a token prompt."""
        job = self._pool.submit(self._tokenizer.decode, token_ids, clean_up_tokenization_spaces=False)
        return await asyncio.wrap_future(job)

    async def run(self, job: Callable[[Any], T]) -> T:
        """``job(tokenizer)`` on the worker, with its private tokenizer (the /tokenize routes' work);
        RuntimeError once the worker is closed."""
        return await asyncio.wrap_future(self._pool.submit(job, self._tokenizer))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    def _decode_vocabulary(self) -> list[str]:
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        size = len(self._tokenizer)
        if backend is not None:
            return backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        return [self._tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in range(size)]
