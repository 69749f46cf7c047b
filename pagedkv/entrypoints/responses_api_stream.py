"""The typed server-sent events of a streamed response, in OpenAI's order and with sequence numbers.

``response.created`` and ``response.in_progress``; per output item ``response.output_item.added``, then for
a message ``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, and for a function call ``response.function_call_arguments.delta`` and
``.done``; ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` when
max_output_tokens cut the answer). Each event is ``event: <type>`` and ``data: <json>``; no ``[DONE]``.

Without tools the text streams as it is generated. With tools, as on the chat route, an answer is a call or
a reply only once it is whole, so its items come when it finishes, each with one delta. If the engine fails
the request, an ``error`` event and ``response.failed`` end the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedkv.engine.async_client import EngineStopped, RequestFailed
from pagedkv.engine.request_stream import RequestStream
from pagedkv.entrypoints.responses_api_objects import (
    EventCounter,
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseError,
)
from pagedkv.entrypoints.serving import EventStreamResponse, engine_error

if TYPE_CHECKING:
    from pagedkv.entrypoints.responses_api import Turn

Event = dict[str, Any]


class TypedEventStream(EventStreamResponse):
    """The chat route's event stream (abort on disconnect, the stall timeout), in the Responses' format."""

    @staticmethod
    def encode(stream: RequestStream, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        return typed_sse(stream, events)


async def typed_sse(stream: RequestStream, events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """Each event as ``event:`` and ``data:`` lines; the request is aborted if the body ends early."""
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    finally:
        stream.abort()


async def response_events(turn: Turn) -> AsyncIterator[Event]:
    events, response = EventCounter(), turn.response
    yield events.event("response.created", response=response.model_dump(mode="json"))
    yield events.event("response.in_progress", response=response.model_dump(mode="json"))
    live = turn.tools is None  # the text streams as generated; with tools it waits to be whole
    if live:
        for event in _message_opening(events, 0, turn.message_id):
            yield event
    text, finish_reason = "", None
    try:
        async for _, output in turn.stream:
            sample = output.outputs[0]
            text, finish_reason = text + sample.delta_text, sample.finish_reason
            if live and sample.delta_text:
                yield _text_delta(events, 0, turn.message_id, sample.delta_text)
    except (EngineStopped, RequestFailed) as exc:
        error = engine_error(exc)
        yield events.event("error", code=error.code, message=error.message, param=None)
        response.status, response.error = "failed", ResponseError(code="server_error", message=error.message)
        yield events.event("response.failed", response=response.model_dump(mode="json"))
        return
    if finish_reason is None:  # aborted: the client left or stopped reading
        return
    items = turn.finish(text, finish_reason)
    for index, item in enumerate(items):
        if not (live and index == 0):
            for event in _item_opening(events, index, item):
                yield event
        for event in _item_closing(events, index, item, deltas=not live):
            yield event
    kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
    yield events.event(kind, response=response.model_dump(mode="json"))


def _message_opening(events: EventCounter, index: int, message_id: str) -> list[Event]:
    item = OutputMessage(id=message_id, status="in_progress")
    return [
        events.event("response.output_item.added", output_index=index, item=item.model_dump(mode="json")),
        events.event(
            "response.content_part.added",
            item_id=message_id,
            output_index=index,
            content_index=0,
            part=OutputText(text="").model_dump(mode="json"),
        ),
    ]


def _text_delta(events: EventCounter, index: int, message_id: str, delta: str) -> Event:
    return events.event(
        "response.output_text.delta", item_id=message_id, output_index=index, content_index=0, delta=delta, logprobs=[]
    )


def _item_opening(events: EventCounter, index: int, item: OutputItem) -> list[Event]:
    if isinstance(item, OutputMessage):
        return _message_opening(events, index, item.id)
    added = item.model_copy(update={"status": "in_progress", "arguments": ""})
    return [events.event("response.output_item.added", output_index=index, item=added.model_dump(mode="json"))]


def _item_closing(events: EventCounter, index: int, item: OutputItem, deltas: bool) -> list[Event]:
    """The rest of an item's events; ``deltas``: its whole text or arguments as one delta first."""
    closing = []
    if isinstance(item, FunctionCallItem):
        where = {"item_id": item.id, "output_index": index}
        if deltas:
            closing.append(events.event("response.function_call_arguments.delta", **where, delta=item.arguments))
        closing.append(events.event("response.function_call_arguments.done", **where, arguments=item.arguments))
    else:
        part = item.content[0]
        if deltas and part.text:
            closing.append(_text_delta(events, index, item.id, part.text))
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        closing.append(events.event("response.output_text.done", **where, text=part.text, logprobs=[]))
        closing.append(events.event("response.content_part.done", **where, part=part.model_dump(mode="json")))
    closing.append(events.event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")))
    return closing
