"""POST /v1/responses through the official ``openai`` client's ``client.responses``, against a live server.

The references are independent of the Responses code: the chat-completions route's greedy answer to the same
conversation (the two routes must render the same prompt), ``jsonschema`` for structured outputs, and the
``openai`` package's own typed models, which every response body and stream event must validate against.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_server import build_app
from tests.live_server import live_server, wait_idle

pytestmark = pytest.mark.slow

MODEL = "smol"
INSTRUCTIONS = "You are a terse assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And what river flows through it?"
STORY = "Write a long story about a lighthouse keeper."
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER_ARGS}
CHAT_WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_ARGS},
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def app():
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=1024, num_threads=1))
    return build_app(engine, MODEL, limits=ServerLimits(max_grammar_bytes=8 * 1024))


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    with live_server(app) as base_url:
        yield openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def respond(client: openai.OpenAI, **kwargs) -> Response:
    """A whole response, checked against the openai package's model of it (strict validation)."""
    kwargs = {"model": MODEL, "temperature": 0, "max_output_tokens": 40} | kwargs
    raw = client.responses.with_raw_response.create(**kwargs)
    Response.model_validate(json.loads(raw.text))  # raises if a required field is missing or mistyped
    return raw.parse()


def streamed(client: openai.OpenAI, **kwargs) -> list:
    """A streamed response's events, each checked against the openai package's model of it."""
    kwargs = {"model": MODEL, "temperature": 0, "max_output_tokens": 40, "stream": True} | kwargs
    events = list(client.responses.create(**kwargs))
    for event in events:
        EVENTS.validate_python(event.to_dict())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def text_of(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    kwargs = {"model": MODEL, "temperature": 0, "max_tokens": 40} | kwargs
    return client.chat.completions.create(messages=messages, **kwargs)


def test_text_answer_equals_the_chat_route_whole_and_streamed(client):
    items = [{"role": "developer", "content": "Prefer short words."}, {"role": "user", "content": QUESTION}]
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "system", "content": "Prefer short words."}]
    reference = chat(client, messages + [{"role": "user", "content": QUESTION}])
    response = respond(client, input=items, instructions=INSTRUCTIONS)
    assert response.output_text == reference.choices[0].message.content
    assert response.status == "completed" and response.incomplete_details is None
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    assert response.usage.output_tokens == reference.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == INSTRUCTIONS and response.model == MODEL

    events = streamed(client, input=items, instructions=INSTRUCTIONS)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(deltas) == events[-4].text == response.output_text
    final = events[-1].response
    assert final.output_text == response.output_text and final.usage.output_tokens == response.usage.output_tokens
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}


def test_the_stream_helper_assembles_the_same_response(client):
    whole = respond(client, input=QUESTION)
    kwargs = {"model": MODEL, "temperature": 0, "max_output_tokens": 40}
    with client.responses.stream(input=QUESTION, **kwargs) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"


def test_max_output_tokens_cuts_and_says_so(client):
    response = respond(client, input=STORY, max_output_tokens=8)
    reference = chat(client, [{"role": "user", "content": STORY}], max_tokens=8)
    assert reference.choices[0].finish_reason == "length"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 8
    assert response.output_text == reference.choices[0].message.content
    events = streamed(client, input=STORY, max_output_tokens=8)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_usage_counts_cached_and_written_prompt_tokens(app, client):
    block_size = app.state.async_engine.engine.config.block_size
    long_input = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 12
    fresh = {"extra_body": {"cache_salt": "usage-test"}}  # no block shared with the tests before
    first = respond(client, input=long_input, max_output_tokens=2, **fresh).usage
    second = respond(client, input=long_input, max_output_tokens=2, **fresh).usage
    full_blocks = first.input_tokens // block_size * block_size
    assert first.input_tokens_details.cached_tokens == 0
    assert first.input_tokens_details.cache_write_tokens == full_blocks
    assert second.input_tokens_details.cached_tokens == full_blocks  # the prompt's last token stays uncomputed
    assert second.input_tokens_details.cache_write_tokens == 0


def test_json_schema_and_json_object_outputs_are_valid(client):
    ask = "Invent a person: give a name and an age as JSON."
    spec = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    response = respond(client, input=ask, text=spec, max_output_tokens=60)
    jsonschema.validate(json.loads(response.output_text), PERSON)
    reference = chat(
        client,
        [{"role": "user", "content": ask}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    assert response.output_text == reference.choices[0].message.content
    assert text_of(streamed(client, input=ask, text=spec, max_output_tokens=60)) == response.output_text
    anything = respond(client, input=ask, text={"format": {"type": "json_object"}}, max_output_tokens=60)
    assert isinstance(json.loads(anything.output_text), dict)


def test_function_tool_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    response = respond(client, input=ask, tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=80)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.status == "completed" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER_ARGS)
    reference = chat(client, ask, tools=[CHAT_WEATHER_TOOL], tool_choice="required", max_tokens=80)
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in reference.choices[0].message.tool_calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected

    events = streamed(client, input=ask, tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=80)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [args for _, args in expected]
    assert "response.function_call_arguments.delta" in [e.type for e in events]

    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"temperature": 21, "sky": "clear"}'}
        for c in calls
    ]
    answer = respond(client, input=[*ask, *[c.to_dict() for c in calls], *results], tools=[WEATHER_TOOL])
    continued = respond(client, input=results, tools=[WEATHER_TOOL], previous_response_id=response.id)
    assert summary(continued) == summary(answer)
    chat_calls = [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]
    chat_back = [*ask, {"role": "assistant", "tool_calls": chat_calls}]
    chat_back += [{"role": "tool", "tool_call_id": r["call_id"], "content": r["output"]} for r in results]
    chat_answer = chat(client, chat_back, tools=[CHAT_WEATHER_TOOL]).choices[0].message
    chat_said = [
        ("function_call", c.function.name, json.loads(c.function.arguments)) for c in chat_answer.tool_calls or []
    ]
    assert summary(answer) == (chat_said or [("message", chat_answer.content)])


def summary(response: Response) -> list[tuple]:
    """What a response said: its messages' text and its calls' names and parsed arguments, in order."""
    return [
        ("message", item.content[0].text)
        if item.type == "message"
        else (item.type, item.name, json.loads(item.arguments))
        for item in response.output
    ]


def test_previous_response_id_continues_like_the_whole_conversation(client):
    first = respond(client, input=QUESTION, instructions=INSTRUCTIONS)
    second = respond(client, input=FOLLOW_UP, instructions=INSTRUCTIONS, previous_response_id=first.id)
    assistant = {"type": "message", "role": "assistant", "id": first.output[0].id, "status": "completed"}
    assistant["content"] = [{"type": "output_text", "text": first.output_text, "annotations": []}]
    whole = [{"role": "user", "content": QUESTION}, assistant, {"role": "user", "content": FOLLOW_UP}]
    assert second.output_text == respond(client, input=whole, instructions=INSTRUCTIONS).output_text
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    system = {"role": "system", "content": INSTRUCTIONS}
    assert second.output_text == chat(client, [system, *messages]).choices[0].message.content
    # instructions are not inherited: without them the continuation is the conversation without a system message
    bare = respond(client, input=FOLLOW_UP, previous_response_id=first.id)
    assert bare.output_text == chat(client, messages).choices[0].message.content
    events = streamed(client, input=FOLLOW_UP, instructions=INSTRUCTIONS, previous_response_id=first.id)
    assert text_of(events) == second.output_text
    # a continuation of a continuation: three turns
    third = respond(client, input="Thanks!", instructions=INSTRUCTIONS, previous_response_id=second.id)
    messages += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks!"}]
    reference = chat(client, [system, *messages])
    assert third.output_text == reference.choices[0].message.content


def test_retrieve_delete_and_store_false(client):
    kept = respond(client, input=QUESTION, metadata={"topic": "geography"}, user="u-1")
    again = client.responses.retrieve(kept.id)
    assert again.model_dump() == kept.model_dump() and again.metadata == {"topic": "geography"}
    client.responses.delete(kept.id)
    for call in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as refused:
        respond(client, input=FOLLOW_UP, previous_response_id=kept.id)
    assert refused.value.body["code"] == "previous_response_not_found"
    assert refused.value.body["param"] == "previous_response_id"
    unstored = respond(client, input=QUESTION, store=False)
    assert unstored.output_text == kept.output_text
    with pytest.raises(openai.BadRequestError):
        respond(client, input=FOLLOW_UP, previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_every_response_above_left_no_request_and_no_block_behind(app, client):
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and app.state.async_engine.num_in_flight == 0
