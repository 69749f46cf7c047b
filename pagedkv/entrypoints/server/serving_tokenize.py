"""POST /tokenize and /detokenize, in vLLM's shapes: what a client needs to count, cut or inspect prompts
with exactly the server's tokenizer and chat template.

``/tokenize`` takes text (``prompt``, special tokens added by default, as vLLM does) or chat ``messages``
(rendered as /v1/chat/completions renders them -- ``chat_template_kwargs`` and ``--chat-template`` included
-- with the generation prompt unless ``add_generation_prompt`` is false, and no special tokens added unless
asked), and answers ``{count, max_model_len, tokens}`` (and ``token_strs`` on request). ``/detokenize``
turns ids back into text; an id outside the vocabulary is a 400 naming it.

Both run on the tokenizer worker (``TokenizerWorker.run``), never on the event loop: a prompt at the
character limit takes tens of milliseconds to tokenize, and every stream would wait that long. The jobs
waiting there are bounded by ``--max-queued-seqs`` too (past it: 503 + Retry-After), so a flood of
tokenize calls cannot queue unbounded work in front of the generation requests' prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.requests import Request

from pagedkv.engine.prompts import encode_text
from pagedkv.entrypoints.server.protocol import APIError, ChatMessage, value_error
from pagedkv.entrypoints.server.request_fields import refuse_unhonoured
from pagedkv.entrypoints.server.serving import ServingContext
from pagedkv.entrypoints.server.tool_calls import chat_prompt

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.entrypoints.server.bodies import BodyParser

MAX_NAMED_IDS = 8  # out-of-vocabulary ids an error lists


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``), as one body."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: Any = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]

    @field_validator("tokens", mode="before")
    @classmethod
    def _ids_only(cls, value: Any) -> Any:
        """One error for a bad list, not one per item (validation must not amplify)."""
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ValueError("tokens must be a list of token ids (integers)")
        return value


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerJobs:
    """The server's tokenizer worker, for these routes: at most ``limit`` jobs waiting or running."""

    def __init__(self, ctx: ServingContext, limit: int) -> None:
        self.ctx = ctx
        self.limit = limit
        self.running = 0

    async def run(self, job: Callable[[Any], Any]) -> Any:
        if self.running >= self.limit:
            message = f"{self.running} tokenize jobs are waiting, at most {self.limit} (--max-queued-seqs)"
            raise APIError(503, message, type="server_overloaded", code="server_overloaded", retry_after=1)
        self.running += 1
        try:
            return await self.ctx.engine.tokenizer.run(job)
        except RuntimeError as exc:  # the worker is closed: the server is shutting down
            raise APIError(503, "the server is shutting down", type="server_error", retry_after=5) from exc
        finally:
            self.running -= 1


def add_tokenize_routes(app: FastAPI, ctx: ServingContext, bodies: BodyParser, engine: LLMEngine) -> None:
    """Register /tokenize and /detokenize on ``app`` (before the engine thread starts: it reads the engine)."""
    jobs = TokenizerJobs(ctx, ctx.limits.max_queued_seqs)
    vocab_size, max_model_len = len(engine.tokenizer), engine.max_model_len

    @app.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        body = await bodies.parse(request, TokenizeRequest)
        ctx.check_model(body.model)
        refuse_unhonoured(body.model_extra or {}, frozenset())
        job = _tokenize_job(body, ctx.native_tools)
        try:
            ids, strs = await jobs.run(job)
        except ValueError as exc:
            raise value_error(exc, prompt_param="messages" if body.messages else "prompt") from exc
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        body = await bodies.parse(request, DetokenizeRequest)
        ctx.check_model(body.model)
        refuse_unhonoured(body.model_extra or {}, frozenset())
        outside = [t for t in body.tokens if not 0 <= t < vocab_size]
        if outside:
            named = ", ".join(map(str, outside[:MAX_NAMED_IDS])) + (", ..." if len(outside) > MAX_NAMED_IDS else "")
            raise APIError(400, f"tokens: {named} not in the vocabulary (ids 0 to {vocab_size - 1})", param="tokens")
        text = await jobs.run(lambda tokenizer: tokenizer.decode(body.tokens))
        return DetokenizeResponse(prompt=text)


def _tokenize_job(body: TokenizeRequest, native_tools: bool) -> Callable[[Any], tuple[list[int], list[str] | None]]:
    """The work for the tokenizer worker: (ids, their token strings if asked for). The body's shape is
    checked here, on the loop; rendering and encoding happen in the job."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt (text) or messages (a chat), not both or neither", param="prompt")
    if body.prompt is not None:
        for name in ("chat_template_kwargs", "add_generation_prompt"):
            if name in body.model_fields_set:
                raise APIError(400, f"{name} applies to messages, not to a prompt: remove it", param=name)
    add_special = body.add_special_tokens if body.add_special_tokens is not None else body.prompt is not None
    chat = None
    if body.messages is not None:
        chat = chat_prompt(body.messages, None, native_tools)
        chat.template_kwargs, chat.add_generation_prompt = body.chat_template_kwargs, body.add_generation_prompt

    def job(tokenizer: Any) -> tuple[list[int], list[str] | None]:
        if chat is None:
            ids = list(tokenizer.encode(body.prompt, add_special_tokens=add_special))
        else:
            ids = chat.token_ids(tokenizer)
            ids = with_special_tokens(tokenizer, ids) if add_special else ids
        return ids, tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

    return job


def with_special_tokens(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` with the special tokens the tokenizer adds around a text (a BOS, an EOS), as it would add them
    encoding the rendered chat: found by encoding one word with and without them."""
    plain = encode_text(tokenizer, "a")
    full = list(tokenizer.encode("a", add_special_tokens=True))
    start = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
    return full[:start] + ids + full[start + len(plain) :]
