"""ResponseStore's bounds and isolation, and the Responses request's translation, without a model.

The reference for the store is a plain list of what should be kept, least recently used first.
"""

from __future__ import annotations

import json

import pytest

from pagedkv.entrypoints.server.protocol import APIError
from pagedkv.entrypoints.server.responses.protocol import ResponsesRequest
from pagedkv.entrypoints.server.responses.store import ResponseStore

ALICE, BOB = "a" * 64, "b" * 64


def put(store: ResponseStore, response_id: str, owner: str = ALICE, text: str = "hi") -> bool:
    return store.put(response_id, owner, [{"role": "user", "content": text}], json.dumps({"id": response_id}).encode())


def test_entries_are_bounded_and_the_least_recently_used_goes_first():
    store = ResponseStore(max_entries=3, max_bytes=10**6)
    for name in "abc":
        put(store, name)
    assert store.get("a", ALICE) is not None  # a is now the most recently used: b goes first
    put(store, "d")
    kept = [name for name in "abcd" if store.get(name, ALICE) is not None]
    assert kept == ["a", "c", "d"] and len(store) == 3


def test_bytes_are_bounded_and_counted_exactly():
    one = ResponseStore(10, 10**6)
    put(one, "x", text="y" * 100)
    size = one.bytes
    assert size == len(json.dumps([{"role": "user", "content": "y" * 100}]).encode()) + len(b'{"id": "x"}')
    store = ResponseStore(max_entries=100, max_bytes=2 * size + size // 2)  # room for two such entries
    for name in "pqr":
        put(store, name, text="y" * 100)
    assert [n for n in "pqr" if store.get(n, ALICE)] == ["q", "r"] and store.bytes == 2 * size
    assert not put(store, "huge", text="z" * 10 * size)  # larger than the whole store: not kept, nothing evicted
    assert store.get("huge", ALICE) is None and len(store) == 2
    assert store.delete("q", ALICE) and store.bytes == size


def test_an_entry_belongs_to_the_credentials_that_made_it():
    store = ResponseStore(10, 10**6)
    put(store, "mine", owner=ALICE)
    assert store.get("mine", BOB) is None and not store.delete("mine", BOB)
    assert store.get("mine", ALICE).conversation() == [{"role": "user", "content": "hi"}]
    put(store, "mine", owner=BOB)  # the same id again replaces the entry, and its owner
    assert store.get("mine", ALICE) is None and len(store) == 1


def request(**fields) -> ResponsesRequest:
    body = ResponsesRequest.model_validate({"input": "hi"} | fields)
    body.check_supported()
    return body


def test_items_become_the_chat_route_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'}
    items = [
        {
            "role": "developer",
            "content": [{"type": "input_text", "text": "be "}, {"type": "input_text", "text": "brief"}],
        },
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call,
        call | {"call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]
    chat_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert request(input=items).input_messages() == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [chat_call, chat_call | {"id": "c2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    body = request(tools=[tool], tool_choice={"type": "function", "name": "f"})
    assert body.chat_tools() == [
        {"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}
    ]
    assert body.chat_tool_choice() == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": False}, "top_logprobs"),  # false is not 0
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_fields_not_honoured_are_refused_by_name(fields, param):
    with pytest.raises(APIError) as refused:
        request(**fields)
    assert refused.value.status == 400 and refused.value.param == param


@pytest.mark.parametrize(
    ("fields", "method", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input_messages",
            "input[0].content[0]",
        ),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "input_messages", "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input_messages", "input[0].role"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input_messages",
            "input[0].arguments",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input_messages", "input[0].call_id"),
        ({"input": ["hi"]}, "input_messages", "input[0]"),
        ({"tools": [{"type": "web_search"}]}, "chat_tools", "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "chat_tools", "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "chat_tools", "tools[0].defer_loading"),
        ({"tool_choice": {"type": "web_search_preview"}}, "chat_tool_choice", "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, "structured_outputs", "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "structured_outputs", "text.format.schema"),
        ({"text": {"verbosity": "low"}}, "structured_outputs", "text.verbosity"),
    ],
)
def test_bad_items_tools_and_formats_are_400s_naming_the_field(fields, method, param):
    with pytest.raises(APIError) as refused:
        getattr(request(**fields), method)()
    assert refused.value.status == 400 and refused.value.param == param
