"""A forwarded request runs through the one-process server's app and streams its ASGI messages back (no Ray
needed): what a replica does for the ingress."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.replicas.forwarding import ForwardedRequest, is_last, run_asgi
from pagedkv.entrypoints.server.openai_server import build_app
from tests.tiny_model import save_tiny_llama

JSON = ((b"content-type", b"application/json"), (b"host", b"127.0.0.1:8000"))
PROMPT = list(range(10, 60))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny")))


def completion(**fields) -> ForwardedRequest:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **fields}).encode()
    return ForwardedRequest("POST", "/v1/completions", headers=JSON, body=body, client=("127.0.0.1", 5))


async def collect(app, request: ForwardedRequest) -> tuple[dict, bytes]:
    """(start message, whole body)."""
    messages = []
    async for batch in run_asgi(app, request, [(b"x-pagedkv-replica", b"r1")]):
        messages += batch
    assert is_last(messages[-1]) and messages[0]["type"] == "http.response.start"
    return messages[0], b"".join(m.get("body", b"") for m in messages[1:])


async def idle_blocks(app, timeout_s: float = 10.0) -> float:
    engine = app.state.async_engine
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)  # the engine thread's next step publishes the stats
    return engine.stats()["kv_blocks_used"]


def test_forwarded_requests_get_the_servers_own_answers(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, num_threads=1))
    app = build_app(engine, "tiny", loopback_only=False)

    async def scenario() -> None:
        app.state.async_engine.start()
        try:
            start, body = await collect(app, completion())
            assert start["status"] == 200 and (b"x-pagedkv-replica", b"r1") in start["headers"]
            answer = json.loads(body)
            assert answer["usage"]["prompt_tokens"] == len(PROMPT) and answer["usage"]["completion_tokens"] == 4

            start, body = await collect(app, completion())
            assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 3 blocks reused

            start, body = await collect(app, completion(stream=True, max_tokens=6))
            events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
            assert start["status"] == 200 and events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
            assert len(text.split()) == 6 and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"

            start, body = await collect(app, completion(max_tokens=-1))
            assert start["status"] == 400 and json.loads(body)["error"]["param"] == "max_tokens"

            models = ForwardedRequest("GET", "/v1/models", headers=JSON)
            start, body = await collect(app, models)
            assert json.loads(body)["data"][0]["id"] == "tiny"
        finally:
            await app.state.async_engine.shutdown()

    asyncio.run(scenario())


def test_a_consumer_that_stops_reading_aborts_the_request_and_frees_its_blocks(model_dir):
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, num_threads=1))
    app = build_app(engine, "tiny", loopback_only=False)

    async def scenario() -> None:
        app.state.async_engine.start()
        try:
            stream = run_asgi(app, completion(stream=True, max_tokens=900, ignore_eos=True))
            first = await stream.__anext__()
            assert first[0]["status"] == 200, first
            await stream.__anext__()  # generating
            assert app.state.async_engine.num_in_flight == 1
            await stream.aclose()  # what Ray does when the client leaves
            assert await idle_blocks(app) == 0
            registry = app.state.async_engine.metrics.registry
            assert registry.get_sample_value("pagedkv:requests_total", {"finish_reason": "abort"}) == 1
        finally:
            await app.state.async_engine.shutdown()

    asyncio.run(scenario())
