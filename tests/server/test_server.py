"""The OpenAI-compatible server, live on a loopback port, driven by the `openai` client and raw httpx.

References are the same engine's offline greedy outputs, computed before the server takes the engine over
(the engine is single-threaded: once serving, only its thread may touch it).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_server import build_app
from pagedkv.sampling_params import SamplingParams
from tests.live_server import live_server, wait_healthy, wait_idle

pytestmark = pytest.mark.slow

MODEL, KEY, MAX_QUEUED, MAX_BODY, MAX_TOKENS = "smol", "test-key", 40, 64 * 1024, 8
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXT_PROMPTS = ["The capital of France is", "Once upon a time"]
CONCURRENT = [f"Question {i}: name a fruit that starts with {chr(65 + i % 26)}." for i in range(32)]
# Several full 16-token blocks, so a repeat of it hits the prefix cache.
SYSTEM = "You are a careful assistant. Answer in one short sentence, plainly, without any preamble. " * 3


def run_offline(engine: LLMEngine, token_lists: list[list[int]], params: SamplingParams) -> list:
    ids = [engine.add_request(prompt_token_ids=t, params=params) for t in token_lists]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # One torch thread: the server's own threads share the cores, and 2-thread ops stall when they do.
    return LLMEngine(EngineConfig(num_kv_blocks=512, max_model_len=512, num_threads=1))


@pytest.fixture(scope="module")
def reference(engine: LLMEngine) -> dict:
    chat_ids = engine.apply_chat_template(QUESTION)
    text_ids = [engine.encode(p) for p in TEXT_PROMPTS]
    concurrent_ids = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in CONCURRENT]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = run_offline(engine, [chat_ids, *text_ids, *concurrent_ids], greedy)
    # The scoring references run cold; the server scores the same prompts with their blocks cached.
    scored = run_offline(engine, [text_ids[1], chat_ids], SamplingParams(prompt_logprobs=3, max_tokens=0))
    return {
        "scores": scored[0].prompt_logprobs,
        "chat_scores": scored[1].prompt_logprobs,
        "chat": outs[0],
        "chat_prompt_len": len(chat_ids),
        "text": [o.text for o in outs[1:3]],
        "text_ids": text_ids,
        "concurrent": [o.text for o in outs[3:]],
    }


@pytest.fixture(scope="module")
def server(engine: LLMEngine, reference: dict):
    limits = ServerLimits(max_queued_seqs=MAX_QUEUED)
    app = build_app(engine, MODEL, api_key=KEY, max_body_bytes=MAX_BODY, limits=limits)
    with live_server(app) as base_url:
        yield app, base_url
    assert not app.state.async_engine.is_running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def metric_samples(base_url: str) -> dict[tuple[str, tuple], float]:
    families = text_string_to_metric_families(httpx.get(base_url + "/metrics", headers=AUTH).text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def aborts(base_url: str) -> float:
    return metric_samples(base_url).get(("pagedkv:requests_total", (("finish_reason", "abort"),)), 0.0)


def test_health_and_models(server, client, engine):
    assert httpx.get(server[1] + "/health").status_code == 200
    models = httpx.get(server[1] + "/v1/models", headers=AUTH)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert str(engine.model_path) not in models.text and "/" not in models.json()["data"][0]["root"]


def test_chat_matches_offline_greedy(client, reference):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    ref = reference["chat"]
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == reference["chat_prompt_len"]
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_matches_offline_greedy(client, reference):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference["chat"].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(reference["chat"].token_ids)
    assert chunks[-1].usage.prompt_tokens == reference["chat_prompt_len"]


def test_completions_text_and_token_prompts(client, reference):
    resp = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == reference["text"]
    assert resp.usage.prompt_tokens == sum(len(t) for t in reference["text_ids"])
    by_ids = client.completions.create(
        model=MODEL, prompt=reference["text_ids"][0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert by_ids.choices[0].text == reference["text"][0]


def test_completions_stream_raw_sse(server, reference):
    body = {"model": MODEL, "prompt": TEXT_PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0}
    body["stream"] = True
    with httpx.stream("POST", server[1] + "/v1/completions", json=body, headers=AUTH) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference["text"][1]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


def test_echo_scoring_call_of_evaluation_harnesses(client, reference):
    """lm-eval's loglikelihood request: echo the prompt with its logprobs, generate nothing."""
    resp = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[1], echo=True, logprobs=3, max_tokens=0)
    choice, expected = resp.choices[0], reference["scores"]
    assert choice.text == TEXT_PROMPTS[1] and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(expected)
    lp = choice.logprobs
    assert len(lp.tokens) == len(expected) and "".join(lp.tokens) == TEXT_PROMPTS[1]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e.logprob for e in expected[1:]]  # bitwise: cache cold offline, warm here
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(
        len(top) <= 3 and max(top.values()) >= lp.token_logprobs[i + 1] for i, top in enumerate(lp.top_logprobs[1:])
    )


def test_prompt_logprobs_extra_field_and_echo_with_generation(server, client, reference):
    expected = reference["scores"]
    resp = client.completions.create(
        model=MODEL,
        prompt=TEXT_PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0,
        echo=True,
        extra_body={"prompt_logprobs": 2},
    )
    choice = resp.model_dump()["choices"][0]
    assert choice["text"] == TEXT_PROMPTS[1] + reference["text"][1]
    scores = choice["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(expected)
    for position, entry in zip(scores[1:], expected[1:], strict=True):
        assert len(position) <= 3 and position[str(entry.token_id)]["logprob"] == entry.logprob
        for rank, (token, logprob) in enumerate(entry.top_logprobs[:2], start=1):
            assert (position[str(token)]["logprob"], position[str(token)]["rank"]) == (logprob, rank)
    chat = httpx.post(
        server[1] + "/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 2, "prompt_logprobs": 0},
        headers=AUTH,
    ).json()
    got = [None if p is None else next(v["logprob"] for v in p.values()) for p in chat["prompt_logprobs"]]
    assert got == [None] + [e.logprob for e in reference["chat_scores"][1:]]


def test_echo_stream_sends_the_prompt_and_its_scores_first(server, reference):
    body = {"model": MODEL, "prompt": TEXT_PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    body |= {"echo": True, "logprobs": 1}
    with httpx.stream("POST", server[1] + "/v1/completions", json=body, headers=AUTH) as resp:
        chunks = [
            json.loads(line.removeprefix("data: ")) for line in resp.iter_lines() if line and "[DONE]" not in line
        ]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(TEXT_PROMPTS[1])
    assert first["logprobs"]["token_logprobs"][1 : len(reference["scores"])] == [
        e.logprob for e in reference["scores"][1:]
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT_PROMPTS[1] + reference["text"][1]


def test_32_concurrent_streams_are_correct_and_free_every_block(server, reference):
    app, base_url = server

    def run(prompt: str) -> str:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(max_workers=32) as pool:
        assert list(pool.map(run, CONCURRENT)) == reference["concurrent"]
    assert wait_idle(app)["kv_blocks_used"] == 0
    assert app.state.async_engine.engine.kv.num_used_blocks == 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    app, base_url = server
    before = aborts(base_url)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, headers=AUTH) as resp:
        lines = resp.iter_lines()
        assert any(next(lines).startswith("data: {") for _ in range(4))
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0
    assert aborts(base_url) == before + 1


def test_disconnect_while_waiting_for_a_whole_response_aborts(server):
    app, base_url = server
    before = aborts(base_url)
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
    assert wait_idle(app)["kv_blocks_used"] == 0
    assert aborts(base_url) == before + 1


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ERROR_CASES = [  # (path, body, status, param)
    (CHAT, {"model": MODEL, "messages": QUESTION, "temperature": -1}, 400, "temperature"),
    (CHAT, {"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"model": MODEL, "messages": QUESTION, "top_p": 0}, 400, "top_p"),
    (CHAT, {"model": MODEL, "messages": QUESTION, "n": 0}, 400, "n"),
    (CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (CHAT, {"model": MODEL, "messages": QUESTION, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": QUESTION, "presence_penalty": 3}, 400, "presence_penalty"),
    (CHAT, {"model": MODEL, "messages": QUESTION, "functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["hi"] * (MAX_QUEUED + 1), "max_tokens": 1}, 503, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES)
def test_errors_are_openai_shaped_and_the_server_keeps_serving(server, client, path, body, status, param):
    resp = httpx.post(server[1] + path, json=body, headers=AUTH)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_auth_body_size_and_bad_json_errors(server, client):
    url = server[1] + COMPLETIONS
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(url, json={"model": MODEL, "prompt": "hi"}, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[1] + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server[1] + "/health").status_code == 200  # health needs no key: probes have none
    assert httpx.get(server[1] + "/metrics").status_code == 401  # everything else does
    assert httpx.get(server[1] + "/metrics", headers=AUTH).status_code == 200
    big = httpx.post(url, json={"model": MODEL, "prompt": "x" * (MAX_BODY + 1)}, headers=AUTH)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(url, content=iter([b'{"prompt": "', b"x" * MAX_BODY, b'"}']), headers=AUTH)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    bad = httpx.post(url, content=b'{"prompt": ', headers=AUTH | {"Content-Type": "application/json"})
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert httpx.get(server[1] + "/v1/nothing-here", headers=AUTH).status_code == 404
    ok = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_cache_salt_isolates_prefix_cache(client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a planet."}]

    def cached(salt: str) -> int:
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
        )
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_metrics_parse_and_prefix_cache_counters_move(server, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    before = metric_samples(server[1])
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    after = metric_samples(server[1])

    def delta(name: str, labels: tuple = ()) -> float:
        return after[("pagedkv:" + name, labels)] - before.get(("pagedkv:" + name, labels), 0.0)

    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and delta("prefix_cache_hits_total") == cached
    assert delta("prefix_cache_queries_total") >= resp.usage.prompt_tokens
    assert delta("prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("generation_tokens_total") == resp.usage.completion_tokens
    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("requests_total", (("finish_reason", resp.choices[0].finish_reason),)) == 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_blocks_used"):
        assert ("pagedkv:" + gauge, ()) in after
    assert delta("spec_decode_draft_tokens_total") == 0  # exported; this server runs without drafts
    # a request answered in one piece has no inter-token gap; a stream of 3 tokens has two
    assert delta("inter_token_latency_seconds_count") == 0
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) == 3
    streamed = metric_samples(server[1])
    key = ("pagedkv:inter_token_latency_seconds_count", ())
    assert streamed[key] - after[key] == 2


def test_logprobs_and_n(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(t.logprob <= 0 and t.top_logprobs for t in content)
    assert content[0].logprob == pytest.approx(max(t.logprob for t in content[0].top_logprobs))
    comp = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=4, temperature=0, logprobs=1)
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens
    many = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS, max_tokens=3, n=2, seed=7)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert 4 <= many.usage.completion_tokens <= 12


def test_cli_serve_exits_0_on_sigterm_mid_stream():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "pagedkv.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "512",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base_url)
        body = {"messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
