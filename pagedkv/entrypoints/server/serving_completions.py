"""POST /v1/completions: text or token-id prompts, one engine request per prompt.

Choice ``index`` is ``prompt_index * n + sample_index``, as in the OpenAI API, so a batch of prompts with
n samples each comes back in one flat list that a client can map back without extra fields. ``echo`` and
vLLM's ``prompt_logprobs`` return the prompt's scores (``pagedkv.entrypoints.server.prompt_scores``); streamed,
they come with each choice's first event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from pagedkv.engine.async_client import RequestStream
from pagedkv.engine.prompts import EnginePrompt
from pagedkv.engine.request import CompletionOutput, RequestOutput
from pagedkv.entrypoints.server.openai_objects import CompletionChoice, CompletionResponse
from pagedkv.entrypoints.server.openai_requests import CompletionRequest
from pagedkv.entrypoints.server.prompt_scores import echo_choice, echoed_prompt, vllm_prompt_logprobs
from pagedkv.entrypoints.server.protocol import APIError
from pagedkv.entrypoints.server.serving import (
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
    stream = await ctx.start("cmpl", prompts, params, body.cache_salt, "prompt", body.stream, body.grammar_renames())
    if body.stream:
        events = _stream_events(ctx, stream, body, params.n)
        return EventStreamResponse(stream, events, ctx.limits.stream_stall_timeout_s)
    outputs = await collect(stream, request)
    choices = []
    for i, output in enumerate(outputs):
        prompt_text = await echoed_prompt(ctx, output) if body.echo else None
        for sample in output.outputs:
            index = i * params.n + sample.index
            choices.append(_choice(ctx, body, output, sample, index, prompt_text, delta=False, first=True))
    response = CompletionResponse(id=stream.request_id, model=ctx.model_name, choices=choices, usage=usage(stream))
    return Response(response.model_dump_json(), media_type="application/json")


def _choice(
    ctx: ServingContext,
    body: CompletionRequest,
    output: RequestOutput,
    sample: CompletionOutput,
    index: int,
    prompt_text: str | None,
    delta: bool,
    first: bool,
    offset: int = 0,
) -> CompletionChoice:
    """One choice, or one event of it; ``prompt_text`` (echo) and the prompt's scores come in the first."""
    if prompt_text is not None:
        text, logprobs = echo_choice(ctx, output, prompt_text, sample, delta, body.logprobs)
    else:
        text = sample.delta_text if delta else sample.text
        logprobs = completion_logprobs(ctx, sample, delta, offset=offset)
    scores = None
    if body.prompt_logprobs is not None and first:
        scores = vllm_prompt_logprobs(ctx, output.prompt_logprobs or [], body.prompt_logprobs)
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
        prompt_logprobs=scores,
    )


async def _stream_events(
    ctx: ServingContext, stream: RequestStream, body: CompletionRequest, n: int
) -> AsyncIterator[CompletionResponse]:
    chunk = partial(CompletionResponse, id=stream.request_id, created=int(time.time()), model=ctx.model_name)
    reported: set[tuple[int, int]] = set()
    sent_chars: dict[tuple[int, int], int] = {}  # text already streamed per choice: logprobs' text_offset
    async for index, output in stream:
        choices = []
        for sample in fresh_samples(index, output, reported):
            key = (index, sample.index)
            first = key not in sent_chars
            prompt_text = await echoed_prompt(ctx, output) if body.echo and first else None
            offset = sent_chars.get(key, 0)
            choice = _choice(ctx, body, output, sample, index * n + sample.index, prompt_text, True, first, offset)
            sent_chars[key] = offset + len(choice.text)
            choices.append(choice)
        if choices:
            yield chunk(choices=choices)
    if body.include_usage:
        yield chunk(choices=[], usage=usage(stream))
