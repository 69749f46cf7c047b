"""POST /v1/chat/completions: the model's chat template turns messages into one prompt.

Streaming follows the OpenAI shape: a first chunk per choice carrying ``role``, then content deltas, then
a chunk with the finish_reason, then (with ``stream_options.include_usage``) a usage chunk with no choices.
vLLM's ``prompt_logprobs`` extra field scores the rendered prompt: a top-level field of the response, or of
the first chunk that has them.

With tools (see ``tool_calls``), an answer is a call or a reply only once it is whole, so a streamed answer
comes in one delta when it finishes: its ``content``, or its ``tool_calls`` with ``finish_reason: "tool_calls"``.

With ``--reasoning-parser`` (see ``reasoning``), the thinking comes apart as ``message.reasoning_content``
(streamed: ``delta.reasoning_content``); tools are parsed from the answer after it, and a structured output
constrains that answer only (``reasoning_grammar``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from pagedkv.engine.async_client import RequestStream
from pagedkv.engine.request import CompletionOutput, RequestOutput
from pagedkv.entrypoints.server.openai_objects import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    DeltaToolCall,
    PromptLogprobs,
    ToolCallResponse,
)
from pagedkv.entrypoints.server.openai_requests import ChatCompletionRequest
from pagedkv.entrypoints.server.prompt_scores import vllm_prompt_logprobs
from pagedkv.entrypoints.server.reasoning import ReasoningSplitter, Split, for_the_answer, split_reasoning
from pagedkv.entrypoints.server.serving import (
    EventStreamResponse,
    ServingContext,
    chat_logprobs,
    collect,
    fresh_samples,
    usage,
)
from pagedkv.entrypoints.server.tool_calls import ToolPlan, chat_prompt, plan_tools


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, request: Request) -> Response:
    ctx.check_model(body.model)
    body.check_supported()
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, ctx.native_tools)
    tool_grammar = tools.structured_outputs() if tools is not None else None
    params = for_the_answer(ctx.reasoning_parser, body.to_sampling_params(tool_grammar))
    prompt = [chat_prompt(body.messages, tools, ctx.native_tools)]
    prompt[0].template_kwargs = body.chat_template_kwargs  # checked on the tokenizer worker (EnginePrompt)
    grammar = {"structured_outputs": "tools"} if tool_grammar is not None else body.grammar_renames()
    renames = body.param_renames() | grammar  # the engine's refusals name the fields this request used
    stream = await ctx.start("chatcmpl", prompt, params, body.cache_salt, "messages", body.stream, renames)
    if body.stream:
        events = _stream_events(ctx, stream, body, params.n, tools)
        return EventStreamResponse(stream, events, ctx.limits.stream_stall_timeout_s)
    (output,) = await collect(stream, request)
    choices = []
    for sample in output.outputs:
        parts = split_reasoning(ctx.reasoning_parser, sample.text) if ctx.reasoning_parser else Split("", sample.text)
        content, calls, finish_reason = _answer(tools, parts.content, sample.finish_reason)
        if ctx.reasoning_parser:
            content = content or None
        message = AssistantMessage(content=content, tool_calls=calls or None, reasoning_content=parts.reasoning or None)
        choices.append(
            ChatChoice(
                index=sample.index,
                message=message,
                logprobs=chat_logprobs(ctx, sample, delta=False),
                finish_reason=finish_reason,
                stop_reason=sample.stop_reason,
            )
        )
    response = ChatCompletionResponse(
        id=stream.request_id,
        model=ctx.model_name,
        choices=choices,
        usage=usage(stream),
        prompt_logprobs=_prompt_scores(ctx, body, output),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _answer(
    tools: ToolPlan | None, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCallResponse], str | None]:
    """(content, tool calls, finish_reason) of a finished answer: with tools, the calls parsed out of it."""
    if tools is None:
        return text, [], finish_reason
    content, calls = tools.parse(text)
    return content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _whole_answer_delta(tools: ToolPlan, text: str, finish_reason: str | None) -> tuple[ChatDelta, str | None]:
    """A streamed answer with tools: empty until it finishes, then its content or calls in one delta."""
    if finish_reason is None:
        return ChatDelta(), None
    content, calls, finish_reason = _answer(tools, text, finish_reason)
    deltas = [DeltaToolCall(index=i, **c.model_dump()) for i, c in enumerate(calls)]
    return ChatDelta(content=content, tool_calls=deltas or None), finish_reason


def _delta_parts(splitters: list[ReasoningSplitter] | None, sample: CompletionOutput) -> Split:
    """The reasoning and answer parts of a sample's new text (all answer without a reasoning parser); at its
    finish, with what the splitter held back."""
    if splitters is None:
        return Split(content=sample.delta_text)
    splitter = splitters[sample.index]
    parts = splitter.feed(sample.delta_text)
    if sample.finish_reason is not None:
        rest = splitter.finish()
        parts = Split(parts.reasoning + rest.reasoning, parts.content + rest.content)
    return parts


def _prompt_scores(ctx: ServingContext, body: ChatCompletionRequest, output: RequestOutput) -> PromptLogprobs | None:
    if body.prompt_logprobs is None or output.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(ctx, output.prompt_logprobs, body.prompt_logprobs)


async def _stream_events(
    ctx: ServingContext, stream: RequestStream, body: ChatCompletionRequest, n: int, tools: ToolPlan | None
) -> AsyncIterator[ChatCompletionChunk]:
    chunk = partial(ChatCompletionChunk, id=stream.request_id, created=int(time.time()), model=ctx.model_name)
    yield chunk(choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(n)])
    reported: set[tuple[int, int]] = set()
    answers = [""] * n  # with tools: each sample's answer so far, parsed when it finishes
    splitters = [ReasoningSplitter(ctx.reasoning_parser) for _ in range(n)] if ctx.reasoning_parser else None
    scores_sent = False
    async for index, output in stream:
        choices = []
        for sample in fresh_samples(index, output, reported):
            parts, finish_reason = _delta_parts(splitters, sample), sample.finish_reason
            delta = ChatDelta(content=parts.content or None, reasoning_content=parts.reasoning or None)
            if tools is not None:
                answers[sample.index] += parts.content
                if finish_reason is None and not body.logprobs and not parts.reasoning:
                    continue  # nothing to say until the answer is whole
                delta, finish_reason = _whole_answer_delta(tools, answers[sample.index], finish_reason)
                delta.reasoning_content = parts.reasoning or None
            if delta == ChatDelta() and finish_reason is None and not body.logprobs:
                continue  # text held back while the splitter decides whether it is a tag
            choices.append(
                ChatChunkChoice(
                    index=sample.index,
                    delta=delta,
                    logprobs=chat_logprobs(ctx, sample, delta=True),
                    finish_reason=finish_reason,
                )
            )
        scores = None if scores_sent else _prompt_scores(ctx, body, output)
        scores_sent |= scores is not None
        if choices or scores:
            yield chunk(choices=choices, prompt_logprobs=scores)
    if body.include_usage:
        yield chunk(choices=[], usage=usage(stream))
