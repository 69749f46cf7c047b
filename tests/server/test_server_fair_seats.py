"""Fair seats and fair steps against a live server (issue 25 rows 5 and 6, build item 4), loopback only.

A greedy victim streams while one other request is served: n=128 samples with a long max_tokens, a ~2,000
token prompt, a chat with 128 tools, an echo-scoring call over a long prompt. Each time the victim's text is
its text alone, it is in every engine step from its first to its last (it never waits for a seat or a turn),
every step it is in stays short (at most ``max_prefill_tokens_with_decodes`` prompt rows and one row per
seat), and afterwards no request or KV block is held. A later client gets its first token in a step the
n=128 samples are still in (it waited 180 s for them to end before fair seats) and before the victim's last
step (the samples ignore EOS: only a seat reclaimed from them serves it before the victim's ends), and a
200-token prompt arriving while the long prompt is computed gets its first token before the long prompt ends
(13 s before prompts shared a step). All counted in engine steps and rows, which a slow machine does not change.

Bounded in time (the file ~1 minute on 2 cores): 16 seats instead of 64 (one request's share is still half),
prompts of ~2,000 tokens instead of 8,000 (still one step of 2,048 rows before fair steps, a gap of seconds),
and a victim of 64 tokens, which spans most of each replay.
"""

from __future__ import annotations

import json
import random
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
MAX_NUM_SEQS = 16
PREFILL_ROWS_WITH_DECODES = 64  # the default: prompt rows in a step while any request decodes
SHORT_STEP_ROWS = PREFILL_ROWS_WITH_DECODES + MAX_NUM_SEQS  # and one decode row per seat: a step the victim is in


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
    config = EngineConfig(
        num_kv_blocks=1024,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_prefill_tokens_with_decodes=PREFILL_ROWS_WITH_DECODES,
        num_threads=1,
    )
    return LLMEngine(config)


@pytest.fixture(scope="module")
def victim_reference(engine: LLMEngine) -> str:
    return greedy_text(engine, VICTIM, VICTIM_TOKENS)


@pytest.fixture(scope="module")
def server(engine: LLMEngine, victim_reference: str):
    app = build_app(engine, "smol")
    with live_server(app) as base_url:
        yield app, base_url


class StepLog:
    """What each engine step scheduled, noted by wrapping the scheduler: (request id, rows, sampled) per
    request. A victim's pace and a later client's wait are then counted in steps and rows, not seconds."""

    def __init__(self, monkeypatch, scheduler) -> None:
        self.steps: list[list[tuple[str, int, bool]]] = []
        schedule = scheduler.schedule

        def noted():
            output = schedule()
            self.steps.append([(s.request.request_id, s.num_scheduled_tokens, s.is_sampled) for s in output.scheduled])
            return output

        monkeypatch.setattr(scheduler, "schedule", noted)

    def of(self, stream_id: str, sampled: bool = False) -> list[int]:
        """The steps that scheduled the response ``stream_id``, or sampled for it (the engine's ids for it
        are ``id-p`` per prompt, ``id-p#k`` per sample)."""
        return [
            index
            for index, step in enumerate(self.steps)
            if any(belongs(rid, stream_id) and (is_sampled or not sampled) for rid, _, is_sampled in step)
        ]


def belongs(request_id: str, stream_id: str) -> bool:
    return request_id.startswith(stream_id + "-")


def replay(server, monkeypatch, victim_reference: str, name: str, attack: Callable) -> StepLog:
    """Run ``attack(base_url, victim, log)`` while a victim streams; the victim's text holds, it is in every
    step from its first to its last, each of them short, and afterwards no request or block is held."""
    app, base_url = server
    log = StepLog(monkeypatch, app.state.async_engine.engine.scheduler)
    victim = VictimStream(base_url, VICTIM, VICTIM_TOKENS)
    victim.start()
    assert victim.decoding.wait(60)
    attack(base_url, victim, log)
    victim.gaps()  # it finished, with its tokens
    steps = log.of(victim.stream_id)
    rows = [sum(r for _, r, _ in log.steps[i]) for i in steps]
    others = [sum(not belongs(rid, victim.stream_id) for rid, _, _ in log.steps[i]) for i in steps]
    print(f"\n{name}: the victim was in {len(steps)} steps of up to {max(rows)} rows, beside up to {max(others)}")
    assert "".join(victim.text) == victim_reference
    missed = steps[-1] - steps[0] + 1 - len(steps)
    assert missed == 0, f"{name}: the victim sat out {missed} steps between its first and its last"
    assert max(others) > 0, "the attack never shared a step with the victim"
    assert max(rows) <= SHORT_STEP_ROWS, f"{name}: the victim waited for a step of {max(rows)} rows"
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and not stats["num_requests_running"] and not stats["num_requests_waiting"]
    assert app.state.async_engine.num_in_flight == 0 and not app.state.async_engine.engine.processor.groups
    return log


def test_n_128_leaves_seats_to_the_victim_and_a_later_client(server, monkeypatch, victim_reference):
    app, _ = server
    engine = app.state.async_engine.engine
    ids: dict[str, str] = {}

    def attack(base_url: str, victim: VictimStream, log: StepLog) -> None:
        # ignore_eos: no sample ends early, so without seat reclaim only the victim's end frees a seat
        body = {"prompt": "Write a long story.", "n": 128, "max_tokens": 3000, "temperature": 1.0, "seed": 1}
        body["ignore_eos"] = True
        events = threading.Event()
        stop = threading.Event()
        statuses: list[int] = []

        def many() -> None:
            with httpx.stream("POST", base_url + COMPLETIONS, json=body | {"stream": True}, timeout=120) as resp:
                statuses.append(resp.status_code)
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        ids.setdefault("many", json.loads(line.removeprefix("data: "))["id"])
                        events.set()
                    if stop.is_set():
                        break  # the client goes away: the server aborts its 128 samples
            events.set()

        thread = threading.Thread(target=many)
        thread.start()
        assert events.wait(60) and statuses == [200]
        ids["victim"] = victim.stream_id
        while len(engine.scheduler.running) < engine.scheduler.max_num_seqs:  # it took every free seat
            time.sleep(0.01)
        assert victim.is_alive(), "the victim ended before the later client came: nothing left to check"
        with httpx.stream(
            "POST", base_url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 4, "stream": True}, timeout=120
        ) as r:
            assert r.status_code == 200
            first = json.loads(
                next(line for line in r.iter_lines() if line.startswith("data: {")).removeprefix("data: ")
            )
            assert first["choices"][0]["text"] is not None
            ids["later"] = first["id"]
        victim.join(120)  # the victim goes on beside the 128 samples to its end
        stop.set()
        thread.join(60)

    log = replay(server, monkeypatch, victim_reference, "n=128", attack)
    first_token = log.of(ids["later"], sampled=True)[0]
    assert first_token in log.of(ids["many"]), "the later client's first token waited for the 128 samples to end"
    # The victim's seat, freed at its end, would also serve it: only a reclaimed seat serves it before that.
    victim_last = log.of(ids["victim"])[-1]
    print(f"the later client's first token at step {first_token}, the victim's last step {victim_last}")
    assert first_token < victim_last, "the later client waited for the victim's seat: no seat was reclaimed for it"


def test_a_long_prompt_leaves_the_victim_short_steps_and_a_later_prompt_its_part(server, monkeypatch, victim_reference):
    app, _ = server
    engine = app.state.async_engine.engine
    ids: dict[str, str] = {}

    def attack(base_url: str, victim: VictimStream, log: StepLog) -> None:
        def long() -> None:
            body = {"prompt": random_prompt(LONG_PROMPT_TOKENS, seed=1), "max_tokens": 1}
            resp = httpx.post(base_url + COMPLETIONS, json=body, timeout=600)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["prompt_tokens"] == LONG_PROMPT_TOKENS
            ids["long"] = resp.json()["id"]

        thread = threading.Thread(target=long)
        thread.start()
        deadline = time.monotonic() + 60  # only ends a test whose long prompt never started
        while not any(r.num_computed_tokens > 200 for r in list(engine.scheduler.running)):  # well into it
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # a 200-token prompt: it had only what the long prompt left, 0-1 tokens a step, until it ended
        body = {"prompt": random_prompt(200, seed=3), "max_tokens": 2, "stream": True}
        with httpx.stream("POST", base_url + COMPLETIONS, json=body, timeout=600) as resp:
            assert resp.status_code == 200
            first = next(line for line in resp.iter_lines() if line.startswith("data: {"))
            ids["later"] = json.loads(first.removeprefix("data: "))["id"]
        thread.join(600)

    log = replay(server, monkeypatch, victim_reference, f"{LONG_PROMPT_TOKENS}-token prompt", attack)
    later, long = log.of(ids["later"], sampled=True)[0], log.of(ids["long"], sampled=True)[0]
    print(f"the later prompt's first token at step {later}, the long prompt's at step {long}")
    assert later < long, "the later 200-token prompt waited for the long prompt's ~1,800 tokens left"


def test_a_chat_with_128_tools_leaves_the_victim_short_steps(server, monkeypatch, victim_reference):
    """128 tools make a ~4,800-token prompt; the client goes away just before the victim finishes (the rest
    of its prefill would take another ~30 s here), which also checks that an abort mid-prompt frees its
    blocks. Not after: with nothing decoding, its next chunk would be a whole 2,048-token step."""
    app, _ = server
    engine = app.state.async_engine.engine

    def attack(base_url: str, victim: VictimStream, log: StepLog) -> None:
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

    replay(server, monkeypatch, victim_reference, "128 tools", attack)


def test_echo_scoring_a_long_prompt_leaves_the_victim_short_steps(server, monkeypatch, victim_reference):
    def attack(base_url: str, victim: VictimStream, log: StepLog) -> None:
        prompt = random_prompt(SCORED_PROMPT_TOKENS, seed=2)
        body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
        resp = httpx.post(base_url + COMPLETIONS, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        logprobs = resp.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == SCORED_PROMPT_TOKENS and logprobs[0] is None and None not in logprobs[1:]

    replay(server, monkeypatch, victim_reference, f"echo scoring {SCORED_PROMPT_TOKENS} tokens", attack)
