"""What completions and chat completions share: starting a request on the engine, waiting for it while
watching for a client that went away or stopped reading, server-sent events, usage and logprob formatting."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from pagedkv.engine.async_client import (
    AsyncEngine,
    EngineOverloaded,
    EnginePrompt,
    EngineStopped,
    RequestFailed,
    RequestStream,
)
from pagedkv.engine.request import CompletionOutput, RequestOutput
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_objects import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagedkv.entrypoints.server.protocol import APIError, echoed, value_error
from pagedkv.kv import cache_report
from pagedkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ServingContext:
    """The engine, the name clients must use for it, the server's limits, the model's tool format and the
    reasoning parser (None: off); shared by the endpoints."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        limits: ServerLimits,
        native_tools: bool,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.native_tools = native_tools  # the chat template renders tools (see tool_calls)
        self.reasoning_parser = reasoning_parser  # one of reasoning.REASONING_PARSERS
        self._token_texts: list[str] = []

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model {echoed(model)} does not exist; this server serves {self.model_name!r}",
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
        stream: bool,
        renames: dict[str, str] | None = None,
    ) -> RequestStream:
        """Tokenize and queue the prompts; map engine refusals to OpenAI errors (400 / 500 / 503).

        ``renames``: the request's own names of engine parameters (a grammar asked for as response_format)."""
        wants_texts = params.logprobs is not None or params.prompt_logprobs is not None
        if wants_texts and not self._token_texts:
            self._token_texts = await self.engine.tokenizer.token_texts()
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return await self.engine.add(request_id, prompts, params, cache_salt, stream)
        except ValueError as exc:
            raise value_error(exc, renames, prompt_param=prompt_param) from exc
        except EngineOverloaded as exc:
            raise APIError(503, str(exc), type="server_overloaded", code="server_overloaded", retry_after=1) from exc
        except (EngineStopped, RequestFailed) as exc:
            raise engine_error(exc) from exc

    def token_text(self, token_id: int) -> str:
        texts = self._token_texts
        return texts[token_id] if 0 <= token_id < len(texts) else ""


def engine_error(exc: EngineStopped | RequestFailed) -> APIError:
    """503 when the server is going away (retry elsewhere or later), 500 when the engine failed this request."""
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc), type="server_error", code="internal_error")
    return APIError(503, str(exc), type="server_error", code="server_shutting_down", retry_after=5)


async def collect(stream: RequestStream, request: Request) -> list[RequestOutput]:
    """Wait for every prompt's final output, aborting if the client disconnects meanwhile."""
    watcher = asyncio.create_task(_abort_on_disconnect(stream, request))
    final: dict[int, RequestOutput] = {}
    try:
        async for index, output in stream:
            final[index] = output
    except (EngineStopped, RequestFailed) as exc:
        raise engine_error(exc) from exc
    finally:
        watcher.cancel()
        stream.abort()
    if stream.aborted:
        raise APIError(499, "the client closed the connection", code="client_closed_request")
    return [final[i] for i in range(len(final))]


async def _abort_on_disconnect(stream: RequestStream, request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.abort()


class ClientStalled(Exception):
    """A streaming client read nothing for longer than the stall timeout."""


class EventStreamResponse(StreamingResponse):
    """Server-sent events; a client that disconnects or stops reading aborts the request and frees its blocks.

    Starlette cancels the response when it sees the disconnect. The generator's ``finally`` covers a cancel
    that lands while it waits for the engine; the background task covers one that lands in ``send``, where
    the generator is merely suspended and would be closed only when garbage collected. A client that keeps
    the socket open but stops reading makes ``send`` wait forever once the socket buffers are full: each
    send gets ``stall_timeout_s``, after which the request is aborted and the connection dropped.
    """

    media_type = "text/event-stream"
    done = "data: [DONE]\n\n"  # after the last event, as OpenAI's streams end ("": nothing)

    def __init__(self, stream: RequestStream, events: AsyncIterator, stall_timeout_s: float) -> None:
        super().__init__(
            self._body(stream, events), media_type=self.media_type, background=BackgroundTask(stream.abort)
        )
        self.stream = stream
        self.stall_timeout_s = stall_timeout_s

    @staticmethod
    def line(event: BaseModel) -> str:
        """One event's text; a subclass streams another format (Ollama's NDJSON, the Responses API's typed
        events) with the same guards."""
        return f"data: {event.model_dump_json()}\n\n"

    @staticmethod
    def error_line(error: APIError) -> str:
        """What the stream says when the engine fails the request mid-stream."""
        return f"data: {json.dumps(error.body())}\n\n"

    async def _body(self, stream: RequestStream, events: AsyncIterator) -> AsyncIterator[str]:
        try:
            async for event in events:
                yield self.line(event)
        except (EngineStopped, RequestFailed) as exc:
            yield self.error_line(engine_error(exc))
        finally:
            stream.abort()
        if self.done:
            yield self.done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def bounded_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except TimeoutError:
                raise ClientStalled from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except ClientStalled:  # starlette collapses a one-exception group to the exception itself
            logger.warning(
                "%s: the client read nothing for %.0f s; aborted", self.stream.request_id, self.stall_timeout_s
            )
            self.stream.abort()
            await self.body_iterator.aclose()  # now, not whenever the suspended generator is collected


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


def usage(stream: RequestStream) -> Usage:
    """Token counts over all prompts; a prompt's tokens count once however many samples it has. The cache
    miss reason of several prompts is the first prompt's that is not "hit" (``cache_report.aggregate``)."""
    reasons = [stream.cache_miss_reasons[i] for i in sorted(stream.cache_miss_reasons)]
    return Usage(
        prompt_tokens=stream.prompt_tokens,
        completion_tokens=stream.completion_tokens,
        total_tokens=stream.prompt_tokens + stream.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(stream.cached_tokens.values())),
        cache_miss_reason=cache_report.aggregate(reasons),
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


def completion_logprobs(
    ctx: ServingContext, sample: CompletionOutput, delta: bool, offset: int = 0
) -> CompletionLogprobs | None:
    """``offset``: characters of this sample's text sent before this delta (text_offset starts there)."""
    if sample.logprobs is None:
        return None
    ids, logprobs, tops = _logprob_slice(sample, delta)
    result = CompletionLogprobs()
    for i, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=False)):
        text = ctx.token_text(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append({ctx.token_text(t): lp for t, lp in (tops[i] if i < len(tops) else [])})
        result.text_offset.append(offset)
        offset += len(text)
    return result
