"""/v1/responses on a server with ``--reasoning-parser``: the thinking as a reasoning item, the answer as a
message, streamed and not, equal to the chat route's ``reasoning_content`` and ``content`` on the same server;
a ``text.format`` holds for the answer after the thinking, as ``response_format`` does on the chat route.

The server is test_reasoning's: the default model under a template that opens the thinking, prompted with
two worked examples, so that its own greedy output thinks, closes ``</think>`` and answers.
"""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.openai_server import build_app
from tests.live_server import live_server, wait_idle
from tests.server.test_reasoning import SHOTS, THINKING_TEMPLATE

pytestmark = pytest.mark.slow

MODEL, MAX_TOKENS = "smol", 40
INSTRUCTIONS, TURNS = SHOTS[0]["content"], SHOTS[1:]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    engine = LLMEngine(EngineConfig(num_kv_blocks=128, max_model_len=512, num_threads=1, chat_template=str(path)))
    return build_app(engine, MODEL, reasoning_parser="deepseek_r1")


@pytest.fixture(scope="module")
def client(app) -> openai.OpenAI:
    with live_server(app) as base_url:
        yield openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_thinking_is_a_reasoning_item_streamed_and_not(app, client):
    chat = client.chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=MAX_TOKENS, temperature=0)
    thinking, answer = chat.choices[0].message.model_extra["reasoning_content"], chat.choices[0].message.content
    assert thinking and answer  # the examples work: the model thinks, then answers

    kwargs = {"model": MODEL, "input": TURNS, "instructions": INSTRUCTIONS, "max_output_tokens": MAX_TOKENS}
    whole = client.responses.create(temperature=0, **kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == thinking and whole.output_text == answer

    events = list(client.responses.create(temperature=0, stream=True, **kwargs))
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event.to_dict())
    with client.responses.stream(temperature=0, **kwargs) as stream:
        final = stream.get_final_response()  # the client's own accumulation of the events
    kinds = [e.type for e in events]
    assert kinds.count("response.reasoning_text.delta") > 1 and kinds.count("response.output_text.delta") > 1
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    streamed_thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed_thinking == thinking and final.output_text == answer
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert [item.id for item in events[-1].response.output] == added

    # the reasoning item sent back with the answer is accepted and, as in a stored conversation, not shown
    back = [*TURNS, *[item.to_dict() for item in whole.output], {"role": "user", "content": "And 4+4?"}]
    replayed = client.responses.create(temperature=0, **(kwargs | {"input": back}))
    continued = client.responses.create(
        temperature=0, previous_response_id=whole.id, **(kwargs | {"input": "And 4+4?"})
    )
    assert replayed.output_text == continued.output_text
    assert wait_idle(app)["kv_blocks_used"] == 0


def test_a_text_format_holds_for_the_answer_after_the_thinking(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    chat_format = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}}
    chat = client.chat.completions.create(
        model=MODEL, messages=SHOTS, max_tokens=MAX_TOKENS, temperature=0, response_format=chat_format
    )
    message = chat.choices[0].message
    kwargs = {"model": MODEL, "input": TURNS, "instructions": INSTRUCTIONS, "max_output_tokens": MAX_TOKENS}
    spec = {"format": {"type": "json_schema", "name": "sum", "schema": schema}}
    reply = client.responses.create(temperature=0, text=spec, **kwargs)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == message.model_extra["reasoning_content"]
    assert reply.output_text == message.content and isinstance(json.loads(reply.output_text)["answer"], int)
