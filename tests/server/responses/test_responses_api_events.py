"""The Responses stream's events for scripted engine outputs, without a model: every event valid under the
``openai`` package's models, numbered in order, and adding up (through the package's own accumulator) to
the final response -- for text cut anywhere, thinking split from the answer, tool calls, and a request the
engine fails mid-stream, which must end in ``error`` and ``response.failed``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from pagedkv.engine.core_thread import RequestFailed
from pagedkv.entrypoints.server.responses.api import ResponsesAPI, Turn
from pagedkv.entrypoints.server.responses.objects import ResponseObject
from pagedkv.entrypoints.server.responses.protocol import ResponsesRequest
from pagedkv.entrypoints.server.responses.store import ResponseStore
from pagedkv.entrypoints.server.responses.stream import response_events
from pagedkv.entrypoints.server.tool_calls import plan_tools

EVENTS = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


class ScriptedStream:
    """What a RequestStream gives the events: deltas, a finish reason on the last, or an engine failure."""

    def __init__(self, deltas: list[str], finish_reason: str = "stop", fail: bool = False) -> None:
        self.deltas, self.finish_reason, self.fail = deltas, finish_reason, fail
        self.prompt_tokens, self.completion_tokens = 20, len(deltas)
        self.cached_tokens, self.cache_miss_reasons = {0: 16}, {0: "hit"}

    async def __aiter__(self):
        for i, delta in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            sample = SimpleNamespace(delta_text=delta, finish_reason=self.finish_reason if last else None)
            yield 0, SimpleNamespace(outputs=[sample])
        if self.fail:
            raise RequestFailed("the engine failed this request")


def run(deltas: list[str], parser: str | None = None, tools: bool = False, **stream_options) -> tuple[list, Turn]:
    ctx = SimpleNamespace(reasoning_parser=parser)
    api = ResponsesAPI(ctx, ResponseStore(8, 10**6), max_model_len=512, block_size=16, prefix_caching=True)
    body = ResponsesRequest(input="hi")
    plan = plan_tools([TOOL], "required", None, native=False) if tools else None
    turn = Turn(
        api, "owner", body, [], plan, ScriptedStream(deltas, **stream_options), ResponseObject(id="r", model="m")
    )

    async def collect() -> list:
        return [event async for event in response_events(turn)]

    events = asyncio.run(collect())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return [EVENTS.validate_python(e) for e in events], turn


def accumulated(events: list):
    """The response as the openai package's stream helper assembles it from the events."""
    state = ResponseStreamState(input_tools=[], text_format=omit)
    for event in events:
        state.handle_event(event)
    return state._completed_response


@pytest.mark.parametrize("deltas", [["Hello", ", ", "world."], [""], ["a"] * 5])
def test_text_events_add_up_to_the_response(deltas):
    events, turn = run(deltas)
    final = accumulated(events)
    assert final.output_text == "".join(deltas) == turn.response.output_text
    assert events[-1].type == "response.completed" and final.usage.input_tokens_details.cached_tokens == 16
    assert final.usage.input_tokens_details.cache_write_tokens == 0  # 20 tokens: one full block, read


@pytest.mark.parametrize(
    ("deltas", "thinking", "answer"),
    [
        (["<thi", "nk>plan ", "it</th", "ink>The ", "answer."], "plan it", "The answer."),
        (["<think>only thinking, cut"], "only thinking, cut", None),
        (["no tags", " here"], None, "no tags here"),
        (["<think>a</think>"], "a", None),
    ],
)
def test_thinking_streams_as_a_reasoning_item_then_the_answer(deltas, thinking, answer):
    events, turn = run(deltas, parser="qwen3")
    kinds = [e.type for e in events]
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (streamed or None) == thinking
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (answer or "")
    if thinking and answer:  # the thinking is done before the answer starts
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = accumulated(events)
    assert [item.type for item in final.output] == [t for t, x in (("reasoning", thinking), ("message", answer)) if x]
    assert [item.id for item in final.output] == [item.id for item in turn.response.output]


def test_tool_calls_come_whole_with_argument_events():
    events, turn = run(['{"tool_calls": [{"name": "f", ', '"arguments": {"x": 1}}]}'], tools=True)
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    assert kinds[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (call,) = accumulated(events).output
    assert (call.type, call.name, call.arguments) == ("function_call", "f", '{"x": 1}')


def test_a_cut_answer_is_incomplete():
    events, _ = run(["Once upon", " a time"], finish_reason="length")
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].status == "incomplete"


def test_an_engine_failure_ends_the_stream_with_error_and_failed():
    events, turn = run(["Hel", "lo"], finish_reason=None, fail=True)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and "engine failed" in events[-1].response.error.message
    assert len(turn.api.store) == 0  # a failed response is not stored
