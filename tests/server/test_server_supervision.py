"""A server whose engine thread dies says so and exits non-zero, so a supervisor restarts it; and the
tokenizer is only ever used by one thread per tokenizer object."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.openai_server import DrainingServer, build_app, run_server
from tests.live_server import live_server, wait_idle

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Count to twenty."}]


class InjectedDeath(BaseException):
    """Not an Exception: nothing in the engine may swallow it, like a real SystemExit / MemoryError path."""


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=128, max_model_len=512, num_threads=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_thread_death_fails_requests_and_exits_non_zero(engine, monkeypatch):
    real_step = engine.core.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise InjectedDeath
        return real_step()

    monkeypatch.setattr(engine.core, "step", step)
    app = build_app(engine, "smol")
    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    seen: dict = {}

    def client() -> None:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        body = {"messages": MESSAGES, "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as resp:
            seen["lines"] = [line for line in resp.iter_lines() if line]
        try:
            seen["health"] = httpx.get(base + "/health", timeout=5).status_code
        except httpx.TransportError:
            seen["health"] = "closed"

    thread = threading.Thread(target=client)
    thread.start()
    watchdog = threading.Timer(60, lambda: setattr(server, "should_exit", True))  # fail, never hang
    watchdog.start()
    code = run_server(server)  # returns once the server shut itself down
    watchdog.cancel()
    thread.join(30)
    assert code == 1
    assert app.state.async_engine.failed and not app.state.async_engine.is_running
    lines = seen["lines"]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "InjectedDeath" in error["message"]
    assert seen["health"] in (503, "closed")
    for group_id in list(engine.processor.groups):  # the dead thread could not clean up; the next test needs the engine
        engine.abort(group_id)


def test_the_tokenizer_is_used_by_one_thread_per_object(engine):
    app = build_app(engine, "smol")
    worker_tokenizer = app.state.async_engine.tokenizer._tokenizer
    assert worker_tokenizer is not engine.tokenizer
    threads: dict[str, set[str]] = {"worker": set(), "engine": set()}

    def record(owner: str, tokenizer, name: str) -> None:
        method = getattr(tokenizer, name)

        def wrapper(*args, **kwargs):
            threads[owner].add(threading.current_thread().name)
            return method(*args, **kwargs)

        setattr(tokenizer, name, wrapper)

    for name in ("encode", "apply_chat_template", "decode"):
        record("worker", worker_tokenizer, name)
        record("engine", engine.tokenizer, name)
    try:
        with live_server(app) as base_url:
            body = {"messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
            assert httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
            prompt = {"prompt": "Hello there", "max_tokens": 6, "stream": True}
            assert httpx.post(base_url + "/v1/completions", json=prompt, timeout=60).status_code == 200
            wait_idle(app)
    finally:
        for name in ("encode", "apply_chat_template", "decode"):
            vars(engine.tokenizer).pop(name, None)
    assert threads["worker"] == {"pagedkv-tokenizer_0"}  # prompts and the logprob token table
    assert threads["engine"] <= {"pagedkv-engine"}  # the engine's own tokenizer detokenizes, on the engine thread


def test_the_server_loads_its_engine_on_a_thread_that_has_exited(monkeypatch):
    """load_engine builds the LLMEngine on a thread of its own, gone before it returns (torch's intra-op
    worker pool of a thread that stays alive slowed every step of the engine thread, see load_engine), and a
    load that fails raises the engine's own error to the caller."""
    from pagedkv.engine import async_client
    from pagedkv.engine import engine as engine_module

    built_on: list[threading.Thread] = []

    class Recording(LLMEngine):
        def __init__(self, config):
            built_on.append(threading.current_thread())
            super().__init__(config)

    monkeypatch.setattr(engine_module, "LLMEngine", Recording)
    loaded = async_client.load_engine(EngineConfig(num_kv_blocks=64, max_model_len=256, num_threads=1))
    assert isinstance(loaded, Recording) and len(built_on) == 1
    assert built_on[0] is not threading.current_thread() and not built_on[0].is_alive()
    with pytest.raises(FileNotFoundError, match="no model at '/nonexistent/model'"):
        async_client.load_engine(EngineConfig(model="/nonexistent/model", num_threads=1))
