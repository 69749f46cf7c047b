"""Fair seats and fair steps against a live server (issue 25 rows 5 and 6, build item 4), loopback only.

A greedy victim streams while one other request is served: n=128 samples with a long max_tokens, a ~2,000
token prompt, a chat with 128 tools, an echo-scoring call over a long prompt. Each time the victim's text is
its text alone, its largest gap between events stays within 3x its median gap + 0.5 s (the issue's target;
the numbers are printed, ``pytest -s``), and afterwards no request or KV block is held. While the n=128
request runs, a later client gets its first token within seconds (it waited 180 s before fair seats), and
so does a 200-token prompt arriving while the long prompt is computed (13 s before prompts shared a step).

Bounded in time (the file ~1 minute on 2 cores): 16 seats instead of 64 (one request's share is still half),
prompts of ~2,000 tokens instead of 8,000 (still one step of 2,048 rows before fair steps, a gap of seconds),
and a victim of 64 tokens, which spans most of each replay.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.openai_server import build_app
from tests.live_server import live_server, wait_idle
from tests.victim_stream import VictimStream, greedy_text

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
VICTIM = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
VICTIM_TOKENS = 64
MAX_MODEL_LEN = 8192  # the default model's own: 128 tools are a ~4,800-token prompt
LONG_PROMPT_TOKENS = 2000  # one step of max_num_batched_tokens (2,048) before fair steps
SCORED_PROMPT_TOKENS = 1200  # scored rows cost twice: as many steps as ~2,400 plain tokens
LATER_FIRST_TOKEN_S = 5.0  # a client arriving while n=128 runs or a long prompt is computed (was minutes, 13 s)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def tools(count: int) -> list[dict]:
    """``count`` small, distinct function tools (the chat template writes each into the prompt)."""
    return [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object", "properties": {}}}}
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=1024, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, num_threads=1))


@pytest.fixture(scope="module")
def victim_reference(engine: LLMEngine) -> str:
    return greedy_text(engine, VICTIM, VICTIM_TOKENS)


@pytest.fixture(scope="module")
def server(engine: LLMEngine, victim_reference: str):
    app = build_app(engine, "smol")
    with live_server(app) as base_url:
        yield app, base_url


def replay(server, victim_reference: str, name: str, attack: Callable[[str, VictimStream], None]) -> None:
    """Run ``attack(base_url, victim)`` while a victim streams; the victim's text and pace hold, and
    afterwards no request or block is held."""
    app, base_url = server
    victim = VictimStream(base_url, VICTIM, VICTIM_TOKENS)
    victim.start()
    assert victim.decoding.wait(60)
    started = time.monotonic()
    attack(base_url, victim)
    ended = time.monotonic()
    gaps = victim.gaps()
    assert len(gaps) > VICTIM_TOKENS // 2
    largest, median = max(gaps), statistics.median(gaps)
    bound = 3 * median + 0.5
    during = sum(started <= t <= ended for t in victim.times)
    print(
        f"\n{name}: victim gaps median {median:.3f} s, largest {largest:.3f} s (bound {bound:.3f} s); "
        f"attack {ended - started:.1f} s, {during} of the victim's {len(victim.times)} events during it"
    )
    assert "".join(victim.text) == victim_reference
    assert largest <= bound, f"{name}: largest gap {largest:.3f} s > {bound:.3f} s, median {median:.3f} s"
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and not stats["num_requests_running"] and not stats["num_requests_waiting"]
    assert app.state.async_engine.num_in_flight == 0 and not app.state.async_engine.engine.processor.groups


def test_n_128_leaves_seats_to_the_victim_and_a_later_client(server, victim_reference):
    app, _ = server
    engine = app.state.async_engine.engine
    first_token_s: list[float] = []

    def attack(base_url: str, victim: VictimStream) -> None:
        body = {"prompt": "Write a long story.", "n": 128, "max_tokens": 3000, "temperature": 1.0, "seed": 1}
        events = threading.Event()
        stop = threading.Event()
        statuses: list[int] = []

        def many() -> None:
            with httpx.stream("POST", base_url + COMPLETIONS, json=body | {"stream": True}, timeout=120) as resp:
                statuses.append(resp.status_code)
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        events.set()
                    if stop.is_set():
                        break  # the client goes away: the server aborts its 128 samples
            events.set()

        thread = threading.Thread(target=many)
        thread.start()
        assert events.wait(60) and statuses == [200]
        while len(engine.scheduler.running) < engine.scheduler.max_num_seqs:  # it took every free seat
            time.sleep(0.01)
        later = time.monotonic()
        with httpx.stream(
            "POST", base_url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 4, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: {"))
            first_token_s.append(time.monotonic() - later)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
        print(f"\nn=128: a later client's first token after {first_token_s[0]:.2f} s")
        victim.join(120)  # the victim goes on beside the 128 samples to its end
        stop.set()
        thread.join(60)

    replay(server, victim_reference, "n=128", attack)
    assert first_token_s[0] <= LATER_FIRST_TOKEN_S


def test_a_long_prompt_leaves_the_victim_short_steps_and_a_later_prompt_its_part(server, victim_reference):
    app, _ = server
    engine = app.state.async_engine.engine
    first_token_s: list[float] = []

    def attack(base_url: str, victim: VictimStream) -> None:
        def long() -> None:
            body = {"prompt": random_prompt(LONG_PROMPT_TOKENS, seed=1), "max_tokens": 1}
            resp = httpx.post(base_url + COMPLETIONS, json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["prompt_tokens"] == LONG_PROMPT_TOKENS

        thread = threading.Thread(target=long)
        thread.start()
        deadline = time.monotonic() + 30
        while not any(r.num_computed_tokens > 200 for r in list(engine.scheduler.running)):  # well into it
            assert time.monotonic() < deadline
            time.sleep(0.02)
        later = time.monotonic()  # a 200-token prompt: it had only what the long prompt left, 0-1 tokens a step
        body = {"prompt": random_prompt(200, seed=3), "max_tokens": 2, "stream": True}
        with httpx.stream("POST", base_url + COMPLETIONS, json=body, timeout=60) as resp:
            assert resp.status_code == 200
            next(line for line in resp.iter_lines() if line.startswith("data: {"))
            first_token_s.append(time.monotonic() - later)
        print(
            f"\n{LONG_PROMPT_TOKENS}-token prompt: a later 200-token prompt's first token in {first_token_s[0]:.2f} s"
        )
        thread.join(120)

    replay(server, victim_reference, f"{LONG_PROMPT_TOKENS}-token prompt", attack)
    assert first_token_s[0] <= LATER_FIRST_TOKEN_S


def test_a_chat_with_128_tools_leaves_the_victim_short_steps(server, victim_reference):
    """128 tools make a ~4,800-token prompt; the client goes away just before the victim finishes (the rest
    of its prefill would take another ~30 s here), which also checks that an abort mid-prompt frees its
    blocks. Not after: with nothing decoding, its next chunk would be a whole 2,048-token step."""
    app, _ = server
    engine = app.state.async_engine.engine

    def attack(base_url: str, victim: VictimStream) -> None:
        body = {"messages": [{"role": "user", "content": "Which tool?"}], "tools": tools(128), "max_tokens": 1}
        client = httpx.Client(timeout=120)
        request = client.build_request("POST", base_url + CHAT, json=body | {"stream": True})
        resp = client.send(request, stream=True)
        assert resp.status_code == 200
        progress = (0, 0)
        while victim.is_alive() and len(victim.times) < VICTIM_TOKENS - 4:
            for r in list(engine.scheduler.running):
                if r.num_prompt_tokens > 4000:  # read across threads: only printed
                    progress = (r.num_computed_tokens, r.num_prompt_tokens)
            time.sleep(0.05)
        resp.close()
        client.close()
        print(f"\n128 tools: {progress[0]} of the prompt's {progress[1]} tokens computed when the client left")
        assert progress[1] > 4000 and progress[0] > 1000

    replay(server, victim_reference, "128 tools", attack)


def test_echo_scoring_a_long_prompt_leaves_the_victim_short_steps(server, victim_reference):
    def attack(base_url: str, victim: VictimStream) -> None:
        prompt = random_prompt(SCORED_PROMPT_TOKENS, seed=2)
        body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
        resp = httpx.post(base_url + COMPLETIONS, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        logprobs = resp.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == SCORED_PROMPT_TOKENS and logprobs[0] is None and None not in logprobs[1:]

    replay(server, victim_reference, f"echo scoring {SCORED_PROMPT_TOKENS} tokens", attack)
