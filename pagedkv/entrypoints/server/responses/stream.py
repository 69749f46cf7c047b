"""The typed server-sent events of a streamed response, in OpenAI's order and with sequence numbers.

``response.created`` and ``response.in_progress``; per output item ``response.output_item.added``, then for
a message ``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, and for a function call ``response.function_call_arguments.delta`` and
``.done``; ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` when
max_output_tokens cut the answer). Each event is ``event: <type>`` and ``data: <json>``; no ``[DONE]``.

Without tools the text streams as it is generated; with ``--reasoning-parser`` the thinking first, as a
reasoning item (``response.reasoning_text.delta`` ... ``.done``), then the answer as a message. With tools,
as on the chat route, an answer is a call or a reply only once it is whole, so its items come when it
finishes, each with one delta. If the engine fails the request, an ``error`` event and ``response.failed``
end the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pagedkv.engine.async_client import EngineStopped, RequestFailed
from pagedkv.entrypoints.server.reasoning import ReasoningSplitter, Split
from pagedkv.entrypoints.server.responses.objects import (
    EventCounter,
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
)
from pagedkv.entrypoints.server.serving import EventStreamResponse, engine_error

if TYPE_CHECKING:
    from pagedkv.entrypoints.server.responses.api import Turn

Event = dict[str, Any]


class TypedEventStream(EventStreamResponse):
    """The chat route's event stream (abort on disconnect, the stall timeout), in the Responses' format: each
    event as ``event:`` and ``data:`` lines. ``response_events`` itself ends a failed stream."""

    done = ""

    @staticmethod
    def line(event: Event) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def response_events(turn: Turn) -> AsyncIterator[Event]:
    events, response = EventCounter(), turn.response
    yield events.event("response.created", response=response.model_dump(mode="json"))
    yield events.event("response.in_progress", response=response.model_dump(mode="json"))
    live = LiveText(events, turn) if turn.tools is None else None  # with tools the answer waits to be whole
    for event in live.start() if live else []:
        yield event
    text, finish_reason = "", None
    try:
        async for _, output in turn.stream:
            sample = output.outputs[0]
            text, finish_reason = text + sample.delta_text, sample.finish_reason
            for event in live.feed(sample.delta_text) if live else []:
                yield event
    except (EngineStopped, RequestFailed) as exc:
        error = engine_error(exc)
        yield events.event("error", code=error.code, message=error.message, param=None)
        response.status, response.error = "failed", ResponseError(code="server_error", message=error.message)
        yield events.event("response.failed", response=response.model_dump(mode="json"))
        return
    if finish_reason is None:  # aborted: the client left or stopped reading
        return
    for event in live.finish() if live else []:
        yield event
    items = turn.finish(text, finish_reason)
    opened = len(live.opened) if live else 0  # the items that streamed are the first ones of the answer
    for index, item in enumerate(items[live.closed if live else 0 :], start=live.closed if live else 0):
        if index >= opened:
            for event in _item_opening(events, index, item):
                yield event
        for event in _item_closing(events, index, item, deltas=index >= opened):
            yield event
    kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
    yield events.event(kind, response=response.model_dump(mode="json"))


class LiveText:
    """An answer without tools, streamed as generated: with a reasoning parser the thinking as a reasoning
    item, closed as the answer begins, then the answer as a message; without, one message, opened before the
    first token."""

    def __init__(self, events: EventCounter, turn: Turn) -> None:
        self.events = events
        parser = turn.reasoning_parser
        self.splitter = ReasoningSplitter(parser) if parser else None
        self.items = {"reasoning": ReasoningItem(id=turn.reasoning_id), "message": OutputMessage(id=turn.message_id)}
        self.opened: list[str] = []  # the kinds of item opened so far, in output order
        self.closed = 0  # how many of those are done already
        self.thinking = ""

    def start(self) -> list[Event]:
        return [] if self.splitter else self._open("message")

    def feed(self, delta: str) -> list[Event]:
        return self._events(self.splitter.feed(delta) if self.splitter else Split(content=delta))

    def finish(self) -> list[Event]:
        """What the splitter held back (the start of a tag that never came)."""
        return self._events(self.splitter.finish()) if self.splitter else []

    def _events(self, parts: Split) -> list[Event]:
        events = []
        self.thinking += parts.reasoning
        for kind, piece in (("reasoning", parts.reasoning), ("message", parts.content)):
            if piece:
                if kind == "message" and self.opened == ["reasoning"]:  # the thinking is over
                    item = ReasoningItem(id=self.items["reasoning"].id, content=[ReasoningText(text=self.thinking)])
                    events += _item_closing(self.events, 0, item, deltas=False)
                    self.closed = 1
                events += [] if kind in self.opened else self._open(kind)
                events.append(_text_delta(self.events, self.opened.index(kind), self.items[kind], piece))
        return events

    def _open(self, kind: str) -> list[Event]:
        self.opened.append(kind)
        return _item_opening(self.events, len(self.opened) - 1, self.items[kind])


def _item_opening(events: EventCounter, index: int, item: OutputItem) -> list[Event]:
    """``output_item.added`` with the item in progress and empty; for text, ``content_part.added``."""
    if isinstance(item, FunctionCallItem):
        added = item.model_copy(update={"status": "in_progress", "arguments": ""})
        return [events.event("response.output_item.added", output_index=index, item=added.model_dump(mode="json"))]
    added = item.model_copy(update={"status": "in_progress", "content": []})
    part = OutputText(text="") if isinstance(item, OutputMessage) else ReasoningText(text="")
    return [
        events.event("response.output_item.added", output_index=index, item=added.model_dump(mode="json")),
        events.event(
            "response.content_part.added",
            item_id=item.id,
            output_index=index,
            content_index=0,
            part=part.model_dump(mode="json"),
        ),
    ]


def _text_delta(events: EventCounter, index: int, item: ReasoningItem | OutputMessage, delta: str) -> Event:
    where = {"item_id": item.id, "output_index": index, "content_index": 0}
    if isinstance(item, ReasoningItem):
        return events.event("response.reasoning_text.delta", **where, delta=delta)
    return events.event("response.output_text.delta", **where, delta=delta, logprobs=[])


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
            closing.append(_text_delta(events, index, item, part.text))
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        if isinstance(item, ReasoningItem):
            closing.append(events.event("response.reasoning_text.done", **where, text=part.text))
        else:
            closing.append(events.event("response.output_text.done", **where, text=part.text, logprobs=[]))
        closing.append(events.event("response.content_part.done", **where, part=part.model_dump(mode="json")))
    closing.append(events.event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")))
    return closing
