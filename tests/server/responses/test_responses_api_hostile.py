"""Hostile input to /v1/responses: each body a 4xx naming its field while a victim streams on unharmed.

The victim is a greedy chat stream (``tests/victim_stream``); its text must equal its text alone on the
engine. No route may bypass a bound: a conversation continued with ``previous_response_id`` counts its stored
turns against the message and character limits. Then the real ``pagedkv serve`` process: the API key, the
Host check and the queue limit hold for the new routes, and the store keeps at most what it is told to.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_server import build_app
from tests.live_server import live_server, wait_healthy, wait_idle
from tests.victim_stream import VictimStream, greedy_text

pytestmark = pytest.mark.slow

RESPONSES = "/v1/responses"
VICTIM = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
VICTIM_TOKENS = 64
LIMITS = ServerLimits(max_prompt_chars=20_000, max_messages=16, max_grammar_bytes=8 * 1024)
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = [  # (body, expected status, expected param)
    ({"input": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "hi", "stream": True, "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400, "input[0].content[0]"),
    ({"input": "hi", "max_output_tokens": True}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "5"}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**12}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": 1e300}, 400, "temperature"),
    ({"input": "hi", "top_p": 1e-50}, 400, "top_p"),
    ({"input": "x" * 100_000}, 400, "input"),
    ({"input": "hi", "instructions": "x" * 100_000}, 400, "input"),
    ({"input": HI * 10_000}, 400, "input"),
    ({"input": HI * 20}, 400, "input"),
    ({"input": "hi \ud800"}, 400, "input"),
    ({"input": "hi", "cache_salt": "\ud800"}, 400, "cache_salt"),
    ({"input": "hi", "user": {"deep": nested(40)}}, 400, "user"),
    ({"input": 5}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    (
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        400,
        "text.format",
    ),
    (
        {
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"enum": ["x" * 100] * 200}}},
        },
        400,
        "text",
    ),
    ({"input": "hi", "tools": [WEATHER | {"description": "d" * 10_000}]}, 400, "tools"),
    (
        {"input": "hi", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
        400,
        "tools",
    ),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "metadata": {"k": "v" * 1000}}, 400, "metadata"),
    ({"input": "hi", "model": "gpt-4o"}, 404, "model"),
    ({"input": "hi", "max_output_tokens": 2, "temperature": 0}, 200, None),  # and a normal request still works
]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=512, max_model_len=1024, num_threads=1))


@pytest.fixture(scope="module")
def server(engine):
    reference = greedy_text(engine, VICTIM, VICTIM_TOKENS)
    app = build_app(engine, "smol", limits=LIMITS)
    with live_server(app) as base_url:
        yield app, base_url, reference


def assert_idle(app) -> None:
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and not stats["num_requests_running"] and not stats["num_requests_waiting"]
    assert app.state.async_engine.num_in_flight == 0 and app.state.async_engine.num_sequences == 0


def test_hostile_bodies_are_refused_while_a_victim_streams(server):
    app, base_url, reference = server
    victim = VictimStream(base_url, VICTIM, VICTIM_TOKENS)
    victim.start()
    victim.decoding.wait(60)
    failures = []
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for body, status, param in HOSTILE:
            resp = client.post(RESPONSES, content=json.dumps(body))
            got = resp.json()["error"]["param"] if resp.status_code != 200 else None
            if resp.status_code != status or got != param:
                failures.append((str(body)[:80], resp.status_code, resp.text[:200]))
        for method in ("GET", "DELETE"):
            resp = client.request(method, RESPONSES + "/resp_nope")
            if resp.status_code != 404 or resp.json()["error"]["code"] != "not_found":
                failures.append((method, resp.status_code, resp.text[:200]))
    victim.join(120)
    assert not failures
    assert "".join(victim.text) == reference
    assert_idle(app)


def test_a_continued_conversation_counts_its_stored_turns_against_the_limits(server):
    app, base_url, _ = server
    with httpx.Client(base_url=base_url, timeout=60) as client:

        def respond(**body) -> httpx.Response:
            return client.post(RESPONSES, json={"max_output_tokens": 1, "temperature": 0} | body)

        ten = respond(input=HI * 5 + [{"role": "assistant", "content": "hello"}] * 5)
        assert ten.status_code == 200
        refused = respond(input=HI * 8, previous_response_id=ten.json()["id"])  # 11 stored + 8 > 16 messages
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
        assert "--max-messages" in refused.json()["error"]["message"]
        long = respond(input="=" * 15_000)  # within the 20,000 characters, and few tokens (64 '=' a token)
        assert long.status_code == 200, long.text
        refused = respond(input="=" * 6_000, previous_response_id=long.json()["id"])
        assert refused.status_code == 400 and "--max-prompt-chars" in refused.json()["error"]["message"]
    assert_idle(app)


def test_a_client_leaving_mid_stream_aborts_frees_and_stores_nothing(server):
    app, base_url, _ = server
    body = {"input": VICTIM, "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", base_url + RESPONSES, json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        created = next(json.loads(line[6:]) for line in lines if line.startswith("data: "))
        deltas = 0
        for line in lines:
            deltas += '"response.output_text.delta"' in line
            if deltas == 3:
                break
    assert_idle(app)
    assert httpx.get(base_url + RESPONSES + "/" + created["response"]["id"]).status_code == 404


@contextmanager
def pagedkv_serve(*options: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """The real ``pagedkv serve`` on a free loopback port, until the block ends (then SIGTERM)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--port", str(port), *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base_url)
        yield base_url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stdout.read()


def test_pagedkv_serve_keeps_key_host_queue_and_store_bounds_on_the_new_routes():
    options = ("--api-key", "k3y", "--max-queued-seqs", "1", "--max-stored-responses", "2")
    options += ("--num-kv-blocks", "128", "--max-model-len", "512", "--threads", "1")
    with pagedkv_serve(*options) as (base_url, _):
        for method, path in (("POST", RESPONSES), ("GET", RESPONSES + "/x"), ("DELETE", RESPONSES + "/x")):
            assert httpx.request(method, base_url + path, json={"input": "hi"}).status_code == 401
        foreign = {"Authorization": "Bearer k3y", "Host": "attacker.example"}
        assert httpx.post(base_url + RESPONSES, json={"input": "hi"}, headers=foreign).status_code == 421
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="k3y", max_retries=0, timeout=120)
        kwargs = {"temperature": 0, "max_output_tokens": 8}
        long = client.responses.create(input=VICTIM, max_output_tokens=300, stream=True)
        assert next(iter(long)).type == "response.created"
        with pytest.raises(openai.APIStatusError) as busy:  # the queue holds one sequence: the stream's
            client.responses.create(input="hi", **kwargs)
        assert busy.value.status_code == 503
        long.close()
        deadline = time.monotonic() + 30
        while True:  # the abort reaches the engine thread asynchronously
            try:
                kept = [client.responses.create(input="Say one.", **kwargs)]
                break
            except openai.InternalServerError:
                assert time.monotonic() < deadline, "the closed stream still holds the queue"
                time.sleep(0.2)
        kept.append(client.responses.create(input="Say two.", **kwargs))
        continued = client.responses.create(input="Again.", previous_response_id=kept[0].id, **kwargs)
        assert (
            continued.previous_response_id == kept[0].id and continued.usage.input_tokens > kept[0].usage.input_tokens
        )
        with pytest.raises(openai.NotFoundError):  # three stored since: the least recently used went
            client.responses.retrieve(kept[1].id)
        assert client.responses.retrieve(kept[0].id).output_text == kept[0].output_text
