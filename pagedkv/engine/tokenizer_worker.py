"""TokenizerWorker: the server's one thread for tokenizing prompts and rendering chat templates.

The engine thread must only step the engine: tokenizing a long prompt there (seconds for megabytes of text)
would stall every stream. The event loop must not tokenize either, or a long prompt would stall every
connection. And a fast (Rust) tokenizer must not be shared across threads: its encode path takes an internal
borrow that a second thread trips over ("Already borrowed"). So the worker owns a private copy of the
tokenizer, and the engine thread keeps the original for detokenizing: each tokenizer object is used by one
thread only.

Logprob responses need every sampled token's text on the event loop; the worker decodes the whole
vocabulary once (a batch decode, ~0.2 s for 49 k tokens) and the loop reads that table.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.prompts import encode_text, render_chat


@dataclass(slots=True)
class EnginePrompt:
    """One prompt as text, token ids, or chat messages (tokenized on the tokenizer worker)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


class TokenizerWorker:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-tokenizer")
        self._token_texts: Future[list[str]] | None = None

    async def tokenize(self, prompts: list[EnginePrompt]) -> list[list[int]]:
        """Token ids of every prompt; ValueError (a 400) if one cannot be tokenized."""
        return await asyncio.wrap_future(self._pool.submit(self._tokenize_all, prompts))

    async def token_texts(self) -> list[str]:
        """Each token id's text (skip_special_tokens=False, no clean-up), decoded once on first use."""
        if self._token_texts is None:
            self._token_texts = self._pool.submit(self._decode_vocabulary)
        return await asyncio.wrap_future(self._token_texts)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tokenize_all(self, prompts: list[EnginePrompt]) -> list[list[int]]:
        return [self._tokenize(p) for p in prompts]

    def _tokenize(self, prompt: EnginePrompt) -> list[int]:
        if prompt.prompt_token_ids is not None:
            return list(prompt.prompt_token_ids)
        if prompt.messages is not None:
            try:
                return render_chat(self._tokenizer, prompt.messages)
            except Exception as exc:
                raise ValueError(f"messages could not be rendered with the model's chat template: {exc}") from exc
        if prompt.prompt is None:
            raise ValueError("give a prompt, prompt token ids, or messages")
        return encode_text(self._tokenizer, prompt.prompt)

    def _decode_vocabulary(self) -> list[str]:
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        size = len(self._tokenizer)
        if backend is not None:
            return backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        return [self._tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in range(size)]
