"""POST /api/chat and /api/generate: Ollama's generation routes over the same path as the OpenAI ones.

Each request goes through ``ServingContext.start`` (tokenizing, the queue limit, the engine's checks) and
``collect`` or a ``EventStreamResponse`` subclass (client disconnects and stalled readers abort it and free its
blocks), exactly as /v1/chat/completions does; only the bodies differ. Streaming is Ollama's NDJSON: one JSON
object per line, each with a piece of the answer and ``done: false``, then a last one with ``done: true``,
``done_reason`` and the counters (token counts, durations in nanoseconds). A failure mid-stream is a line
``{"error": ...}``, which Ollama's clients raise.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.engine.async_client import RequestStream
from pagedkv.engine.request import CompletionOutput, RequestOutput
from pagedkv.entrypoints.server.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest
from pagedkv.entrypoints.server.ollama.tools import ollama_tool_calls
from pagedkv.entrypoints.server.protocol import APIError, echoed
from pagedkv.entrypoints.server.serving import EventStreamResponse, ServingContext, chat_logprobs, collect
from pagedkv.entrypoints.server.tool_calls import ToolPlan

NS = 1_000_000_000
OllamaRequest = OllamaChatRequest | OllamaGenerateRequest


def rfc3339(timestamp: float) -> str:
    """Ollama's timestamps: RFC 3339 in UTC."""
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def check_model(ctx: ServingContext, model: str) -> None:
    """Ollama names a model ``name:tag`` and ``name`` means ``name:latest``: both reach the served model."""
    if model.removesuffix(":latest") != ctx.model_name:
        raise APIError(404, f"model {echoed(model)} not found; this server serves {ctx.model_name!r}", param="model")


def check_limits(ctx: ServingContext, body: OllamaRequest, max_model_len: int) -> None:
    """The server's bounds on the fields Ollama keeps elsewhere: stop strings in ``options``, the system prompt,
    and ``format``, the grammar (``BodyParser`` already bounded the body, its lists and the prompt text)."""
    stop = (body.options or {}).get("stop")
    system = getattr(body, "system", None) or ""
    prompt = getattr(body, "prompt", "") + system
    try:
        ctx.limits.check({"stop": stop, "prompt": prompt, "response_format": body.format}, max_model_len)
    except APIError as exc:
        exc.param = {"stop": "options.stop", "response_format": "format"}.get(exc.param or "", exc.param)
        raise


async def create_ollama_response(
    ctx: ServingContext, body: OllamaRequest, request: Request, max_model_len: int
) -> Response:
    """The answer to an /api/chat or /api/generate body, whole or streamed."""
    started = time.perf_counter()  # before tokenizing: Ollama's total_duration covers the whole request
    check_model(ctx, body.model)
    body.check_supported()
    check_limits(ctx, body, max_model_len)
    chat = isinstance(body, OllamaChatRequest)
    tools = body.tool_plan(ctx.native_tools)
    prompt = body.engine_prompt(tools, ctx.native_tools)
    if prompt is None:  # Ollama's way to load a model: ours is loaded already
        return JSONResponse(_piece(ctx, chat, "") | {"done": True, "done_reason": "load"})
    tool_grammar = tools.structured_outputs() if tools is not None else None
    params = body.sampling_params(max_model_len, tool_grammar)
    renames = body.renames(tool_grammar)
    stream = await ctx.start("ollama", [prompt], params, None, body.prompt_param, body.stream, renames)
    if body.stream:
        lines = _stream_lines(ctx, stream, chat, tools, started)
        return NDJSONResponse(stream, lines, ctx.limits.stream_stall_timeout_s)
    (output,) = await collect(stream, request)
    answer = _answer(ctx, chat, output.text, tools) | _logprobs(ctx, output.outputs[0], delta=False)
    return JSONResponse(answer | _final_fields(stream, output, started))


def _piece(ctx: ServingContext, chat: bool, text: str) -> dict[str, Any]:
    """One response object's head: the model, the time and this piece of the answer."""
    head = {"model": ctx.model_name, "created_at": rfc3339(time.time())}
    if chat:
        return head | {"message": {"role": "assistant", "content": text}, "done": False}
    return head | {"response": text, "done": False}


def _answer(ctx: ServingContext, chat: bool, text: str, tools: ToolPlan | None) -> dict[str, Any]:
    """A whole answer; with tools, its calls parsed out into ``message.tool_calls``."""
    if tools is None:
        return _piece(ctx, chat, text)
    content, calls = tools.parse(text)
    piece = _piece(ctx, chat, content or "")
    if calls:
        piece["message"]["tool_calls"] = ollama_tool_calls(calls)
    return piece


def _logprobs(ctx: ServingContext, sample: CompletionOutput, delta: bool) -> dict[str, Any]:
    """``logprobs`` of the sample's tokens (all, or the new ones), in the /v1 chat route's per-token shape that
    Ollama's also has: token, logprob, bytes, top_logprobs; nothing when the request did not ask for them."""
    scores = chat_logprobs(ctx, sample, delta)
    return {} if scores is None else {"logprobs": scores.model_dump()["content"]}


def _final_fields(stream: RequestStream, output: RequestOutput, started: float) -> dict[str, Any]:
    """Ollama's counters. The model is loaded once at start-up, so no request spends time loading it
    (``load_duration`` 0); the prompt's time runs from the engine's arrival to the first token, the
    answer's from there to the last token, and the total from ``started`` (all on ``time.perf_counter``,
    the engine's clock)."""
    metrics = output.metrics
    first_token = metrics.get("arrival_time", 0.0) + metrics.get("ttft", 0.0)
    answer_s = max(metrics.get("last_token_time", 0.0) - first_token, 0.0)
    return {
        "done": True,
        "done_reason": output.finish_reason or "stop",
        "total_duration": int((time.perf_counter() - started) * NS),
        "load_duration": 0,
        "prompt_eval_count": stream.prompt_tokens,
        "prompt_eval_duration": int(metrics.get("ttft", 0.0) * NS),
        "eval_count": stream.completion_tokens,
        "eval_duration": int(answer_s * NS),
    }


async def _stream_lines(
    ctx: ServingContext, stream: RequestStream, chat: bool, tools: ToolPlan | None, started: float
) -> AsyncIterator[dict[str, Any]]:
    """The answer piece by piece; with tools, whole once it is finished (only then is it a call or a reply)."""
    text, scores = "", []
    async for _, output in stream:
        sample = output.outputs[0]
        text += sample.delta_text
        new_scores = _logprobs(ctx, sample, delta=True)
        if tools is not None:
            scores += new_scores.get("logprobs", [])  # they go with the whole answer
        elif sample.delta_text or new_scores.get("logprobs"):
            yield _piece(ctx, chat, sample.delta_text) | new_scores
        if output.finished:
            if tools is not None:
                yield _answer(ctx, chat, text, tools) | ({"logprobs": scores} if scores else {})
            yield _piece(ctx, chat, "") | _final_fields(stream, output, started)


class NDJSONResponse(EventStreamResponse):
    """Ollama's stream, one JSON object per line, with the guards of the OpenAI routes' event streams."""

    media_type = "application/x-ndjson"
    done = ""

    @staticmethod
    def line(line: dict[str, Any]) -> str:
        return json.dumps(line) + "\n"

    @staticmethod
    def error_line(error: APIError) -> str:
        return json.dumps({"error": error.message}) + "\n"
