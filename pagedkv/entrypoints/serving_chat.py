"""POST /v1/chat/completions: the model's chat template turns messages into one prompt.

Streaming follows the OpenAI shape: a first chunk per choice carrying ``role``, then content deltas, then
a chunk with the finish_reason, then (with ``stream_options.include_usage``) a usage chunk with no choices.
vLLM's ``prompt_logprobs`` extra field scores the rendered prompt: a top-level field of the response, or of
the first chunk that has them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagedkv.engine.async_client import EnginePrompt, RequestStream
from pagedkv.engine.request import RequestOutput
from pagedkv.entrypoints.prompt_scores import vllm_prompt_logprobs
from pagedkv.entrypoints.protocol import ChatCompletionRequest
from pagedkv.entrypoints.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    PromptLogprobs,
)
from pagedkv.entrypoints.serving import (
    EventStreamResponse,
    ServingContext,
    chat_logprobs,
    collect,
    fresh_samples,
    usage,
)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    ctx.check_model(body.model)
    body.check_supported()
    params = body.to_sampling_params()
    messages = [m.as_template_dict(i) for i, m in enumerate(body.messages)]
    prompt = [EnginePrompt(messages=messages)]
    stream = await ctx.start("chatcmpl", prompt, params, body.cache_salt, prompt_param="messages", stream=body.stream)
    if body.stream:
        events = _stream_events(ctx, stream, body, params.n)
        return EventStreamResponse(stream, events, ctx.limits.stream_stall_timeout_s)
    (output,) = await collect(stream, request)
    response = ChatCompletionResponse(
        id=stream.request_id,
        model=ctx.model_name,
        choices=[
            ChatChoice(
                index=sample.index,
                message=AssistantMessage(content=sample.text),
                logprobs=chat_logprobs(ctx, sample, delta=False),
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            )
            for sample in output.outputs
        ],
        usage=usage(stream),
        prompt_logprobs=_prompt_scores(ctx, body, output),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _prompt_scores(ctx: ServingContext, body: ChatCompletionRequest, output: RequestOutput) -> PromptLogprobs | None:
    if body.prompt_logprobs is None or output.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(ctx, output.prompt_logprobs, body.prompt_logprobs)


async def _stream_events(
    ctx: ServingContext, stream: RequestStream, body: ChatCompletionRequest, n: int
) -> AsyncIterator[ChatCompletionChunk]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=stream.request_id, created=created, model=ctx.model_name, choices=choices, **extra
        )

    yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(n)])
    reported: set[tuple[int, int]] = set()
    scores_sent = False
    async for index, output in stream:
        choices = [
            ChatChunkChoice(
                index=sample.index,
                delta=ChatDelta(content=sample.delta_text) if sample.delta_text else ChatDelta(),
                logprobs=chat_logprobs(ctx, sample, delta=True),
                finish_reason=sample.finish_reason,
            )
            for sample in fresh_samples(index, output, reported)
        ]
        scores = None if scores_sent else _prompt_scores(ctx, body, output)
        scores_sent |= scores is not None
        if choices or scores:
            yield chunk(choices, prompt_logprobs=scores)
    if body.include_usage:
        yield chunk([], usage=usage(stream))
