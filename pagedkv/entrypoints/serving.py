"""What completions and chat completions share: starting a request on the engine, waiting for it while
watching for a client that went away, server-sent events, usage and logprob formatting."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from functools import lru_cache

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from pagedkv.engine.request import CompletionOutput, RequestOutput
from pagedkv.entrypoints.async_engine import (
    AsyncEngine,
    EngineOverloaded,
    EnginePrompt,
    EngineStopped,
    RequestStream,
)
from pagedkv.entrypoints.protocol import APIError, value_error
from pagedkv.entrypoints.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagedkv.sampling import SamplingParams

DONE = "data: [DONE]\n\n"


class ServingContext:
    """The engine plus the name clients must use for it; shared by both endpoints."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    async def start(
        self,
        prefix: str,
        prompts: list[EnginePrompt],
        params: SamplingParams,
        cache_salt: str | None,
        prompt_param: str,
    ) -> RequestStream:
        """Queue the prompts; map engine refusals to OpenAI errors (400 / 503)."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return await self.engine.add(request_id, prompts, params, cache_salt)
        except ValueError as exc:
            raise value_error(exc, prompt_param=prompt_param) from exc
        except EngineOverloaded as exc:
            raise APIError(503, str(exc), type="server_overloaded", code="server_overloaded") from exc
        except EngineStopped as exc:
            raise APIError(503, str(exc), type="server_error", code="server_shutting_down") from exc

    def token_text(self, token_id: int) -> str:
        return self._token_text(token_id)

    def _decode_one(self, token_id: int) -> str:
        return self.engine.engine.tokenizer.decode([token_id])


async def collect(stream: RequestStream, request: Request) -> list[RequestOutput]:
    """Wait for every prompt to finish, aborting if the client disconnects meanwhile."""
    watcher = asyncio.create_task(_abort_on_disconnect(stream, request))
    final: dict[int, RequestOutput] = {}
    try:
        async for index, output in stream:
            final[index] = output
    except EngineStopped as exc:
        raise APIError(503, str(exc), type="server_error", code="server_shutting_down") from exc
    finally:
        watcher.cancel()
        stream.abort()
    if stream.aborted:
        raise APIError(499, "the client closed the connection", code="client_closed_request")
    return [final[i] for i in range(len(final))]


async def _abort_on_disconnect(stream: RequestStream, request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.abort()
            return


def event_stream(stream: RequestStream, events: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events; a client that disconnects aborts the request and frees its blocks.

    Starlette cancels the response when it sees the disconnect. The generator's ``finally`` covers a
    cancel that lands while it waits for the engine; the background task covers one that lands in
    ``send``, where the generator is merely suspended and would be closed only when garbage collected.
    """
    return StreamingResponse(
        _sse(stream, events), media_type="text/event-stream", background=BackgroundTask(stream.abort)
    )


async def _sse(stream: RequestStream, events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"data: {event.model_dump_json()}\n\n"
    except EngineStopped as exc:
        error = APIError(503, str(exc), type="server_error", code="server_shutting_down")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        stream.abort()
    yield DONE


def fresh_samples(index: int, output: RequestOutput, reported: set[tuple[int, int]]) -> list[CompletionOutput]:
    """Samples with new text, tokens, or a finish not yet reported. A group (n > 1) keeps reporting a
    sample that finished early while its siblings run; this keeps its finish_reason from repeating."""
    fresh = []
    for sample in output.outputs:
        key = (index, sample.index)
        if key in reported:
            continue
        if sample.finish_reason is not None:
            reported.add(key)
            fresh.append(sample)
        elif sample.delta_text or sample.delta_token_ids:
            fresh.append(sample)
    return fresh


def usage(outputs: Sequence[RequestOutput | None]) -> Usage:
    """Token counts over all prompts; a prompt's tokens count once however many samples it has."""
    done = [o for o in outputs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in done)
    completion = sum(len(s.token_ids) for o in done for s in o.outputs)
    cached = sum(o.num_cached_tokens for o in done)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _logprob_slice(sample: CompletionOutput, delta: bool) -> tuple[list[int], list[float], list[list]]:
    """The sampled ids, their logprobs and top alternatives: all of them, or only the new ones."""
    ids = sample.delta_token_ids if delta else sample.token_ids
    count = len(ids)
    logprobs = (sample.logprobs or [])[-count:] if count else []
    tops = (sample.top_logprobs or [])[-count:] if count else []
    return ids, logprobs, tops


def chat_logprobs(ctx: ServingContext, sample: CompletionOutput, delta: bool) -> ChatLogprobs | None:
    if sample.logprobs is None:
        return None
    ids, logprobs, tops = _logprob_slice(sample, delta)
    content = []
    for i, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=False)):
        alternatives = [_top(ctx, t, lp) for t, lp in (tops[i] if i < len(tops) else [])]
        text = ctx.token_text(token_id)
        content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def _top(ctx: ServingContext, token_id: int, logprob: float) -> TopLogprob:
    text = ctx.token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def completion_logprobs(ctx: ServingContext, sample: CompletionOutput, delta: bool) -> CompletionLogprobs | None:
    if sample.logprobs is None:
        return None
    ids, logprobs, tops = _logprob_slice(sample, delta)
    offset = len(sample.text) - len(sample.delta_text) if delta else 0
    result = CompletionLogprobs()
    for i, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=False)):
        text = ctx.token_text(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append({ctx.token_text(t): lp for t, lp in (tops[i] if i < len(tops) else [])})
        result.text_offset.append(offset)
        offset += len(text)
    return result
