"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API.

A response runs exactly as a chat completion does: the request becomes chat messages
(``responses.protocol``), tools go through the chat route's planning and parsing (``tool_calls``), and
the prompt through the same ``ServingContext.start`` -- so every bound holds as on the chat route (body and
value limits, the queue limit, API key and Host check in front of every route, abort on disconnect) and the
greedy answer is the chat route's answer to the same conversation. What is added: the answer as output items
(a message, or function calls), usage in the Responses shape, typed stream events (``responses.stream``)
and a bounded store of finished responses for ``previous_response_id`` (``responses.store``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.engine.request_stream import RequestStream
from pagedkv.entrypoints.server.openai_objects import ToolCallResponse
from pagedkv.entrypoints.server.protocol import APIError, ChatMessage, echoed
from pagedkv.entrypoints.server.reasoning import Split, for_the_answer, split_reasoning
from pagedkv.entrypoints.server.responses.objects import (
    FunctionCallItem,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    response_usage,
)
from pagedkv.entrypoints.server.responses.protocol import ResponsesRequest
from pagedkv.entrypoints.server.responses.store import ResponseStore, owner_of
from pagedkv.entrypoints.server.responses.stream import TypedEventStream, response_events
from pagedkv.entrypoints.server.serving import ServingContext, collect
from pagedkv.entrypoints.server.tool_calls import ToolPlan, chat_prompt, plan_tools

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.entrypoints.server.bodies import BodyParser


@dataclass(slots=True)
class ResponsesAPI:
    """What the routes share: the serving context, the store, and what usage needs of the KV cache."""

    ctx: ServingContext
    store: ResponseStore
    max_model_len: int
    block_size: int
    prefix_caching: bool

    def history(self, previous_response_id: str | None, owner: str) -> list[dict[str, Any]]:
        """The stored conversation a request continues; OpenAI's 400 if there is none (for this key)."""
        if previous_response_id is None:
            return []
        entry = self.store.get(previous_response_id, owner)
        if entry is None:
            raise APIError(
                400,
                f"Previous response with id {echoed(previous_response_id)} not found (never stored, made with "
                "store=false, or dropped: the server keeps the most recent --max-stored-responses)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return entry.conversation()

    def check_bounds(self, body: ResponsesRequest, conversation: list[dict[str, Any]]) -> None:
        """The chat route's bounds on the whole prompt, stored turns included, and on ``text``'s grammar."""
        instructions = body.instructions or ""
        chars = len(instructions) + sum(_message_chars(m) for m in conversation)
        messages = len(conversation) + (body.instructions is not None)
        self.ctx.limits.check_conversation("input", messages, chars, self.max_model_len)
        self.ctx.limits.check_spec("text", body.text)


@dataclass(slots=True)
class Turn:
    """One response in the making: the request, the conversation it answers, and the response object."""

    api: ResponsesAPI
    owner: str
    body: ResponsesRequest
    conversation: list[dict[str, Any]]  # instructions left out: a continuation does not inherit them
    tools: ToolPlan | None
    stream: RequestStream
    response: ResponseObject
    message_id: str = field(default_factory=lambda: OutputMessage().id)  # the text answer's item, if any
    reasoning_id: str = field(default_factory=lambda: ReasoningItem().id)  # the thinking's item, if any

    @property
    def reasoning_parser(self) -> str | None:
        return self.api.ctx.reasoning_parser

    def finish(self, text: str, finish_reason: str | None) -> list[OutputItem]:
        """The answer's output items, status and usage, set on the response, which is stored if asked."""
        cut = finish_reason == "length"
        content, calls, items = self._output(text, cut)
        response = self.response
        response.output = items
        response.status = "incomplete" if cut else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        response.usage = response_usage(self.stream, self.api.block_size, self.api.prefix_caching)
        if self.body.store:
            self._store(content, calls)
        return items

    def _output(self, text: str, cut: bool) -> tuple[str | None, list[ToolCallResponse], list[OutputItem]]:
        """(message text, calls, output items): the thinking (with a reasoning parser), the text, the calls."""
        status = "incomplete" if cut else "completed"
        parts = split_reasoning(self.reasoning_parser, text) if self.reasoning_parser else Split(content=text)
        content, calls = (parts.content, []) if self.tools is None or cut else self.tools.parse(parts.content)
        if self.reasoning_parser:
            content = content or None  # a thinking model that only thought gave no message
        items: list[OutputItem] = []
        if parts.reasoning:  # the thinking is complete if an answer follows it
            thinking = [ReasoningText(text=parts.reasoning)]
            done = "completed" if content is not None else status
            items.append(ReasoningItem(id=self.reasoning_id, status=done, content=thinking))
        if content is not None:
            items.append(OutputMessage(id=self.message_id, status=status, content=[OutputText(text=content)]))
        for call in calls:
            items.append(FunctionCallItem(call_id=call.id, name=call.function.name, arguments=call.function.arguments))
        return content, calls, items

    def _store(self, content: str | None, calls: list[ToolCallResponse]) -> None:
        """The conversation with this answer, as the chat messages a continuation renders: without the
        thinking, which the next turn's template would not show either."""
        answer: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            answer["tool_calls"] = [
                {"id": c.id, "type": "function", "function": c.function.model_dump()} for c in calls
            ]
        stored = self.conversation + [answer]
        self.api.store.put(self.response.id, self.owner, stored, self.response.model_dump_json().encode())


async def create_response(api: ResponsesAPI, body: ResponsesRequest, request: Request) -> Response:
    ctx = api.ctx
    ctx.check_model(body.model)
    body.check_supported()
    owner = owner_of(request)
    conversation = api.history(body.previous_response_id, owner) + body.input_messages()
    api.check_bounds(body, conversation)
    tools = plan_tools(body.chat_tools(), body.chat_tool_choice(), body.parallel_tool_calls, ctx.native_tools)
    tool_grammar = tools.structured_outputs() if tools is not None else None
    params = for_the_answer(ctx.reasoning_parser, body.to_sampling_params(tool_grammar))  # after the thinking
    system = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    messages = [ChatMessage.model_validate(m) for m in system + conversation]
    prompt = chat_prompt(messages, tools, ctx.native_tools)
    renames = body.param_renames(tool_grammar is not None)
    stream = await ctx.start("resp", [prompt], params, body.cache_salt, "input", body.stream, renames)
    response = _response_object(ctx, body, stream.request_id.replace("resp-", "resp_", 1))
    turn = Turn(api, owner, body, conversation, tools, stream, response)
    if body.stream:
        return TypedEventStream(stream, response_events(turn), ctx.limits.stream_stall_timeout_s)
    (output,) = await collect(stream, request)
    sample = output.outputs[0]
    turn.finish(sample.text, sample.finish_reason)
    return Response(response.model_dump_json(), media_type="application/json")


def _response_object(ctx: ServingContext, body: ResponsesRequest, response_id: str) -> ResponseObject:
    """The response as it starts: the request's settings echoed, no output yet."""
    return ResponseObject(
        id=response_id,
        model=ctx.model_name,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        text=body.text if body.text and body.text.get("format") else {"format": {"type": "text"}},
        tools=body.tools or [],
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        metadata=body.metadata or {},
        store=body.store,
        user=body.user,
    )


def _message_chars(message: dict[str, Any]) -> int:
    """A chat message's text, and its calls' arguments: what the template will render of it."""
    calls = message.get("tool_calls") or []
    return len(message.get("content") or "") + sum(len(c["function"]["arguments"]) for c in calls)


def add_responses_routes(app: FastAPI, ctx: ServingContext, bodies: BodyParser, engine: LLMEngine) -> None:
    """Register /v1/responses on ``app``, with a store bounded by the server's limits (before the engine thread
    starts: it reads the engine)."""
    limits, config = ctx.limits, engine.config
    store = ResponseStore(limits.max_stored_responses, limits.max_stored_response_bytes)
    api = ResponsesAPI(ctx, store, engine.max_model_len, config.block_size, config.enable_prefix_caching)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = await bodies.parse(request, ResponsesRequest)
        return await create_response(api, body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        entry = api.store.get(response_id, owner_of(request))
        if entry is None:
            raise _not_found(response_id)
        return Response(entry.response_json, media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        if not api.store.delete(response_id, owner_of(request)):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id {echoed(response_id)}", param="response_id", code="not_found")
