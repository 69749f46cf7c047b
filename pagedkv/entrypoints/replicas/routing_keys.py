"""What a prefix-aware router matches a request on: its prompt's block keys, or its prompt text.

The ingress computes this once per request, before routing, from the raw JSON body: the prompt is turned
into token ids exactly as a replica will (the same chat template, tools and tokenizer; a completions batch
is routed by its first prompt), and the ids into pagedkv's block keys (``pagedkv.kv.hashing``) with the
request's ``cache_salt`` in the first key -- the very keys the replica's prefix cache will look up, so
tenants with different salts never share a routing key either. Ray's text-based prefix router gets the
rendered prompt text instead, with the salt in front.

A body that is not a valid request, or whose messages the chat template refuses, gets no key: it is routed
by load alone, and the replica answers it with the usual 400. So does a body over ``MAX_KEYED_BODY_BYTES``:
tokenizing it twice (here and on the replica) is not worth the routing gain, and the replica bounds it anyway.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.prompts import EnginePrompt
from pagedkv.entrypoints.server.openai_requests import ChatCompletionRequest, CompletionRequest
from pagedkv.entrypoints.server.serving_completions import completion_prompts
from pagedkv.entrypoints.server.tool_calls import chat_prompt, plan_tools, template_supports_tools
from pagedkv.kv.hashing import BlockKey, extend_block_keys

logger = logging.getLogger(__name__)

MAX_KEYED_BODY_BYTES = 256 * 1024
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
KEYED_PATHS = (CHAT_PATH, COMPLETIONS_PATH)
KINDS = ("block_keys", "text", "none")


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """``block_keys``: the prompt's full blocks, salted; ``text``: what a text matcher sees (never empty)."""

    block_keys: tuple[BlockKey, ...] = ()
    text: str = ""


class RoutingKeys:
    """Routing keys of one kind (``KINDS``); not thread-safe (a fast tokenizer must stay on one thread)."""

    def __init__(self, tokenizer: Any, block_size: int, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.kind = kind
        self.native_tools = template_supports_tools(tokenizer)

    def of(self, method: str, path: str, body: bytes) -> RoutingKey:
        fallback = RoutingKey(text=f"{method} {path}")
        if self.kind == "none" or method != "POST" or path not in KEYED_PATHS or len(body) > MAX_KEYED_BODY_BYTES:
            return fallback
        try:
            prompt, salt = self._prompt(path, json.loads(body))
            if self.kind == "text":
                text = self._text(prompt)
                return RoutingKey(text=f"{salt}\n{text}" if salt else text or fallback.text)
            keys: list[BlockKey] = []
            extend_block_keys(keys, prompt.token_ids(self.tokenizer), self.block_size, salt)
            return RoutingKey(block_keys=tuple(keys), text=fallback.text)
        except Exception:  # not a valid request, or messages the chat template refuses: the replica says why
            logger.debug("no routing key for %s %s", method, path, exc_info=True)
            return fallback

    def _prompt(self, path: str, body: Any) -> tuple[EnginePrompt, str | None]:
        """The request's (first) prompt as the serving code builds it, and its cache salt."""
        if path == COMPLETIONS_PATH:
            request = CompletionRequest.model_validate(body)
            return completion_prompts(request.prompt)[0], request.cache_salt
        chat = ChatCompletionRequest.model_validate(body)
        tools = plan_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls, self.native_tools)
        return chat_prompt(chat.messages, tools, self.native_tools), chat.cache_salt

    def _text(self, prompt: EnginePrompt) -> str:
        if prompt.prompt_token_ids is not None:
            return " ".join(map(str, prompt.prompt_token_ids))
        if prompt.messages is not None:
            return self.tokenizer.apply_chat_template(
                prompt.messages, tools=prompt.tools, add_generation_prompt=True, tokenize=False
            )
        return prompt.prompt or ""
