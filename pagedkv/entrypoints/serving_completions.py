"""POST /v1/completions: text or token-id prompts, one engine request per prompt.

Choice ``index`` is ``prompt_index * n + sample_index``, as in the OpenAI API, so a batch of prompts with
n samples each comes back in one flat list that a client can map back without extra fields.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagedkv.engine.async_client import EnginePrompt, RequestStream
from pagedkv.entrypoints.protocol import APIError, CompletionRequest
from pagedkv.entrypoints.responses import CompletionChoice, CompletionResponse
from pagedkv.entrypoints.serving import (
    EventStreamResponse,
    ServingContext,
    collect,
    completion_logprobs,
    fresh_samples,
    usage,
)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[EnginePrompt]:
    if isinstance(prompt, str):
        return [EnginePrompt(prompt=prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty: give a string, a list of strings, or a list of token ids", param="prompt")
    if isinstance(prompt[0], str):
        return [EnginePrompt(prompt=p) for p in prompt]
    if isinstance(prompt[0], int):
        return [EnginePrompt(prompt_token_ids=list(prompt))]
    return [EnginePrompt(prompt_token_ids=list(p)) for p in prompt]


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    ctx.check_model(body.model)
    body.check_supported()
    params = body.to_sampling_params()
    prompts = completion_prompts(body.prompt)
    stream = await ctx.start("cmpl", prompts, params, body.cache_salt, prompt_param="prompt", stream=body.stream)
    if body.stream:
        events = _stream_events(ctx, stream, body, params.n)
        return EventStreamResponse(stream, events, ctx.limits.stream_stall_timeout_s)
    outputs = await collect(stream, request)
    response = CompletionResponse(
        id=stream.request_id,
        model=ctx.model_name,
        choices=[
            CompletionChoice(
                index=i * params.n + sample.index,
                text=sample.text,
                logprobs=completion_logprobs(ctx, sample, delta=False),
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            )
            for i, output in enumerate(outputs)
            for sample in output.outputs
        ],
        usage=usage(stream),
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _stream_events(
    ctx: ServingContext, stream: RequestStream, body: CompletionRequest, n: int
) -> AsyncIterator[CompletionResponse]:
    created = int(time.time())
    reported: set[tuple[int, int]] = set()
    sent_chars: dict[tuple[int, int], int] = {}  # text already streamed per choice: logprobs' text_offset
    async for index, output in stream:
        choices = []
        for sample in fresh_samples(index, output, reported):
            key = (index, sample.index)
            offset = sent_chars.get(key, 0)
            sent_chars[key] = offset + len(sample.delta_text)
            choices.append(
                CompletionChoice(
                    index=index * n + sample.index,
                    text=sample.delta_text,
                    logprobs=completion_logprobs(ctx, sample, delta=True, offset=offset),
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                )
            )
        if choices:
            yield CompletionResponse(id=stream.request_id, created=created, model=ctx.model_name, choices=choices)
    if body.include_usage:
        yield CompletionResponse(
            id=stream.request_id, created=created, model=ctx.model_name, choices=[], usage=usage(stream)
        )
