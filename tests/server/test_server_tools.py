"""Structured outputs and tool calling through the live server, driven by the ``openai`` client.

Every JSON answer is parsed and validated with ``jsonschema`` (independent of the grammar library); streamed
answers must equal the whole ones (greedy). Tool calling is tested in both formats: the generic one (the
default model's template knows no tools) and the native one, on the same model given a Hermes-style
template that renders ``tools`` itself.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_server import build_app
from tests.live_server import live_server, wait_idle

pytestmark = pytest.mark.slow

MODEL = "smol"
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": TIME_ARGS}},
]
ARGS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
ASK = [{"role": "user", "content": "What is the weather like in Paris and in Tokyo?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
# A Hermes-style template (the format of Qwen 2.5, Hermes and others) that renders tools itself.
NATIVE_TEMPLATE = """
{%- if tools %}<|im_start|>system
You can call functions. Their signatures:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call answer <tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=1024, num_threads=1))


def _app(engine: LLMEngine):
    return build_app(engine, MODEL, limits=ServerLimits(max_grammar_bytes=8 * 1024))


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def app():
    return _app(_engine())


@pytest.fixture(scope="module")
def server(app):
    with live_server(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return _client(server)


def _chat(client: openai.OpenAI, **kwargs):
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 120, "temperature": 0} | kwargs
    return client.chat.completions.create(**kwargs)


def _streamed_answer(client: openai.OpenAI, **kwargs) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed chat answer."""
    content, calls, finish = "", [], None
    for chunk in _chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    return content, calls, finish


def _checked_calls(message, allowed: set[str]) -> list[tuple[str, dict]]:
    """The message's calls, each one naming an allowed function with arguments valid under its schema."""
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, ARGS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_response_format_json_schema_whole_and_streamed(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ask = [{"role": "user", "content": "Describe a famous painter as JSON."}]
    whole = _chat(client, messages=ask, response_format=response_format, max_tokens=200)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    streamed, _, finish = _streamed_answer(client, messages=ask, response_format=response_format, max_tokens=200)
    assert (streamed, finish) == (whole.choices[0].message.content, "stop")
    sampled = _chat(client, messages=ask, response_format={"type": "json_object"}, temperature=1.0, seed=7, n=3)
    for choice in sampled.choices:
        assert isinstance(json.loads(choice.message.content), dict)


def test_structured_outputs_and_guided_fields_on_both_endpoints(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    completion = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=20, extra_body={"structured_outputs": {"regex": phone}}
    )
    assert re.fullmatch(phone, completion.choices[0].text)
    choices = ["Paris", "Rome", "Tokyo"]
    chat = _chat(client, extra_body={"guided_choice": choices}, temperature=1.0, seed=3, n=4)
    assert all(c.message.content in choices for c in chat.choices)
    chat = _chat(client, extra_body={"structured_outputs": {"grammar": 'start: "yes" | "no"'}})
    assert chat.choices[0].message.content in ("yes", "no")


def test_tool_choice_required_named_and_one_call_at_a_time(client):
    required = _chat(client, tools=TOOLS, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and not required.message.content
    assert _checked_calls(required.message, {"get_weather", "get_time"})
    named = _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].finish_reason == "tool_calls"
    assert _checked_calls(named.choices[0].message, {"get_time"})
    single = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(_checked_calls(single.message, {"get_weather", "get_time"})) == 1
    sampled = _chat(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=11, n=4
    )
    for choice in sampled.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert _checked_calls(choice.message, {"get_weather", "get_time"})


def test_streamed_tool_calls_equal_the_whole_answer(client):
    whole = _chat(client, tools=TOOLS, tool_choice="required").choices[0]
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    content, calls, finish = _streamed_answer(client, tools=TOOLS, tool_choice="required")
    assert (content, calls, finish) == ("", expected, "tool_calls")


def test_auto_answers_with_calls_or_text_and_none_ignores_tools(client):
    for seed in range(3):
        choice = _chat(client, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and _checked_calls(choice.message, set(ARGS))
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content
    plain = _chat(client, max_tokens=16)
    none = _chat(client, max_tokens=16, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # tools are left out of the prompt


def test_calls_and_results_go_back_into_the_prompt(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"},
    ]
    first = _chat(client, tools=TOOLS, max_tokens=1)
    after = _chat(client, messages=history, tools=TOOLS, tool_choice="auto")
    assert after.usage.prompt_tokens > first.usage.prompt_tokens + 10
    choice = after.choices[0]
    assert choice.message.content or _checked_calls(choice.message, set(ARGS))


def test_max_tokens_inside_a_call_is_length_and_no_calls(client):
    choice = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=6).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


BAD_BODIES = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (
        {"tools": [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 200}} for i in range(64)]},
        "tools",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"response_format": {"type": "text"}, "guided_regex": "("}, "guided_regex"),  # text asks for no grammar
    (
        {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
        "messages[1].tool_calls[0]",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD_BODIES)
def test_bad_tools_and_formats_are_400s_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4} | extra
    response = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_every_request_above_left_no_request_and_no_block_behind(app, server):
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == stats["num_requests_waiting"] == 0


@pytest.fixture(scope="module")
def native():
    engine = _engine()
    engine.tokenizer.chat_template = NATIVE_TEMPLATE
    expected_prompt = len(engine.apply_chat_template(ASK, tools=TOOLS))
    with live_server(_app(engine)) as base_url:
        yield _client(base_url), expected_prompt


def test_native_template_gets_the_tools_and_calls_parse(native):
    client, expected_prompt = native
    required = _chat(client, tools=TOOLS, tool_choice="required")
    assert required.usage.prompt_tokens == expected_prompt  # rendered by the template, nothing added
    assert required.choices[0].finish_reason == "tool_calls"
    assert _checked_calls(required.choices[0].message, set(ARGS))
    named = _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert _checked_calls(named.choices[0].message, {"get_time"})
    content, calls, finish = _streamed_answer(client, tools=TOOLS, tool_choice="required")
    expected = [(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls]
    assert (content, calls, finish) == ("", expected, "tool_calls")
