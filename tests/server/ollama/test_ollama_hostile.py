"""Hostile inputs on Ollama's routes, against a live server on the default model: each gets a 4xx in Ollama's
error shape naming its field while a victim stream (through the real ``ollama`` client) goes on to exactly
its undisturbed greedy text; the API key, the Host check, the queue limit and disconnect handling hold on
these routes as on /v1, and nothing is left behind (no request, no KV block)."""

from __future__ import annotations

import json
import threading

import httpx
import ollama
import pytest

from pagedkv.engine.engine import LLMEngine
from tests.live_server import live_server, wait_idle
from tests.ollama_server import (
    AUTH,
    MAX_BODY,
    MODEL,
    QUESTION,
    VICTIM,
    VICTIM_TOKENS,
    WEATHER,
    new_engine,
    ollama_app,
    run_offline,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return new_engine()


@pytest.fixture(scope="module")
def victim_reference(engine: LLMEngine) -> str:
    return run_offline(engine, engine.apply_chat_template(VICTIM), VICTIM_TOKENS).text


@pytest.fixture(scope="module")
def server(engine: LLMEngine, victim_reference: str):
    app = ollama_app(engine)
    with live_server(app) as base_url:
        yield app, base_url


CHAT, GENERATE = "/api/chat", "/api/generate"
Q = {"model": MODEL, "messages": QUESTION}
G = {"model": MODEL, "prompt": "hi"}
HOSTILE = [  # (path, body, status, a phrase the error must hold)
    (CHAT, Q | {"options": {"num_gpu": 1}}, 400, "options.num_gpu"),
    (CHAT, Q | {"options": {"x" * 50_000: 1}}, 400, "options.xxx"),
    (CHAT, Q | {"options": {"mirostat": 2}}, 400, "options.mirostat"),
    (CHAT, Q | {"options": {"repeat_last_n": 64}}, 400, "options.repeat_last_n"),
    (CHAT, Q | {"options": {"num_ctx": 10**6}}, 400, "options.num_ctx"),
    (CHAT, Q | {"options": {"num_predict": 10**6}}, 400, "options.num_predict"),
    (CHAT, Q | {"options": {"num_predict": -5}}, 400, "options.num_predict"),
    (CHAT, Q | {"options": {"temperature": "hot"}}, 400, "options.temperature"),
    (CHAT, Q | {"options": {"temperature": -1}}, 400, "options.temperature"),
    (CHAT, Q | {"options": {"top_k": 1.5}}, 400, "options.top_k"),
    (CHAT, Q | {"options": {"seed": 2**80}}, 400, "options.seed"),
    (CHAT, Q | {"options": {"stop": ["x"] * 100}}, 400, "options.stop"),
    (CHAT, Q | {"options": {"stop": [1, 2]}}, 400, "options.stop"),
    (CHAT, Q | {"options": ["temperature"]}, 400, "options"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "images"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "surrogate"),
    (CHAT, Q | {"tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
    (CHAT, Q | {"tools": [WEATHER], "format": "json"}, 400, "tools"),
    (
        CHAT,
        {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        400,
        "messages[0].tool_calls[0]",
    ),
    (CHAT, Q | {"think": True}, 400, "think"),
    (CHAT, Q | {"top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, Q | {"logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    (CHAT, Q | {"format": "yaml"}, 400, "format"),
    (CHAT, Q | {"format": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, 400, "format"),
    (CHAT, Q | {"stream": "yes"}, 400, "stream"),
    (CHAT, Q | {"temperature": 0}, 400, "temperature"),  # Ollama's is options.temperature: not silently ignored
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "x"}]}, 400, "messages[0].name"),
    (CHAT, {"model": "llama3", "messages": QUESTION}, 404, "llama3"),
    (CHAT, {"messages": QUESTION}, 400, "model"),
    (GENERATE, G | {"template": "{{ .Prompt }}"}, 400, "template"),
    (GENERATE, G | {"suffix": "end"}, 400, "suffix"),
    (GENERATE, G | {"context": [1, 2, 3]}, 400, "context"),
    (GENERATE, G | {"images": ["aGk="]}, 400, "images"),
    (GENERATE, G | {"raw": True, "system": "be brief"}, 400, "system"),
    (GENERATE, {"model": MODEL, "prompt": "word " * 4000}, 400, "prompt"),
    (GENERATE, {"model": MODEL, "prompt": "hi", "system": "word " * 4000}, 400, "prompt"),
    (GENERATE, {"model": MODEL, "prompt": "x" * (MAX_BODY + 1)}, 413, "larger than"),
]


def test_hostile_inputs_get_4xx_while_a_victim_streams(server, victim_reference):
    app, base_url = server
    victim_text: list[str] = []
    victim_client = ollama.Client(host=base_url, headers=AUTH, timeout=120)

    def victim() -> None:
        options = {"temperature": 0, "num_predict": VICTIM_TOKENS}
        for part in victim_client.chat(model=MODEL, messages=VICTIM, options=options, stream=True):
            victim_text.append(part.message.content)

    thread = threading.Thread(target=victim)
    thread.start()
    failures = []
    with httpx.Client(base_url=base_url, timeout=30, headers=AUTH) as http:
        for path, body, status, phrase in HOSTILE:
            resp = http.post(path, content=json.dumps(body))
            error = resp.json().get("error") if resp.status_code != 200 else None  # a 200 streams NDJSON
            wrong = not isinstance(error, str) or phrase not in error or len(error) > 1000  # echoes are capped
            if resp.status_code != status or wrong:
                failures.append((path, phrase, resp.status_code, resp.text[:200]))
        for headers, status in (({"Authorization": "Bearer wrong"}, 401), ({"Host": "attacker.example"}, 421)):
            resp = http.post(CHAT, json=Q, headers=headers)
            if resp.status_code != status or not isinstance(resp.json().get("error"), str):
                failures.append((headers, resp.status_code, resp.text[:200]))
        bad = http.post(CHAT, content=b'{"model": ', headers={"Content-Type": "application/json"})
        if bad.status_code != 400 or "JSON" not in bad.json()["error"]:
            failures.append(("bad json", bad.status_code, bad.text[:200]))
    with pytest.raises(ollama.ResponseError) as keyless:
        ollama.Client(host=base_url).chat(model=MODEL, messages=QUESTION)
    thread.join(120)
    assert not failures
    assert keyless.value.status_code == 401 and "API key" in keyless.value.error
    assert "".join(victim_text) == victim_reference
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and app.state.async_engine.num_in_flight == 0


def test_queue_limit_and_disconnects_hold_on_the_ollama_routes(server):
    app, base_url = server
    story = {"model": MODEL, "options": {"temperature": 0, "num_predict": 300}}  # a long answer: it outlives the test
    long_generate = story | {"prompt": VICTIM[0]["content"]}
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as http:
        with (
            http.stream("POST", GENERATE, json=long_generate) as first,
            http.stream("POST", CHAT, json=story | {"messages": VICTIM}) as second,
        ):
            readers = [first.iter_lines(), second.iter_lines()]  # kept: a dropped reader closes its stream
            assert all(json.loads(next(lines))["done"] is False for lines in readers)
            refused = http.post(CHAT, json=Q | {"options": {"num_predict": 2}})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert "--max-queued-seqs" in refused.json()["error"]
        # both streams closed mid-answer: their requests are aborted and their blocks freed
        assert wait_idle(app)["kv_blocks_used"] == 0
        with pytest.raises(httpx.ReadTimeout):
            http.post(GENERATE, json=long_generate | {"stream": False}, timeout=1.0)
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and app.state.async_engine.num_in_flight == 0
