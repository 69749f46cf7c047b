"""Ollama's API on the pagedkv server, driven by the real ``ollama`` client against a live server on the default model.

References are the same engine's offline greedy outputs, computed before the server takes the engine over,
and the OpenAI route of the same server; the model facts are checked against the GGUF file read by the
``gguf`` package. Hostile inputs on these routes: tests/server/ollama/test_ollama_hostile.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import httpx
import jsonschema
import ollama
import pytest

from pagedkv.engine.engine import LLMEngine
from tests.live_server import live_server
from tests.ollama_server import (
    AUTH,
    CONTEXT,
    MAX_TOKENS,
    MODEL,
    QUESTION,
    WEATHER,
    new_engine,
    ollama_app,
    run_offline,
)

pytestmark = pytest.mark.slow

SYSTEM = "You answer in one short sentence."
RAW_PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "num_predict": MAX_TOKENS}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return new_engine()


@pytest.fixture(scope="module")
def reference(engine: LLMEngine) -> dict:
    chat_ids = engine.apply_chat_template(QUESTION)
    system_ids = engine.apply_chat_template([{"role": "system", "content": SYSTEM}, *QUESTION])
    return {
        "chat": run_offline(engine, chat_ids, MAX_TOKENS),
        "chat_prompt_len": len(chat_ids),
        "system": run_offline(engine, system_ids, MAX_TOKENS),
        "raw": run_offline(engine, engine.encode(RAW_PROMPT), MAX_TOKENS),
    }


@pytest.fixture(scope="module")
def server(engine: LLMEngine, reference: dict):
    with live_server(ollama_app(engine)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server, headers=AUTH, timeout=120)


def assert_counters(final, prompt_len: int, tokens: int, done_reason: str) -> None:
    assert final.done and final.done_reason == done_reason
    assert final.prompt_eval_count == prompt_len and final.eval_count == tokens
    assert final.load_duration == 0 and final.prompt_eval_duration > 0 and final.eval_duration >= 0
    assert final.total_duration >= final.prompt_eval_duration + final.eval_duration


def test_chat_equals_offline_greedy_and_the_openai_route(server, client, reference):
    resp = client.chat(model=MODEL, messages=QUESTION, options=GREEDY)
    ref = reference["chat"]
    assert resp.message.role == "assistant" and resp.message.content == ref.text
    assert_counters(resp, reference["chat_prompt_len"], len(ref.token_ids), ref.finish_reason)
    openai_body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": MAX_TOKENS}
    openai = httpx.post(server + "/v1/chat/completions", json=openai_body, headers=AUTH, timeout=60).json()
    assert openai["choices"][0]["message"]["content"] == resp.message.content


def test_chat_streamed_is_ndjson_ending_in_one_final_object(client, reference):
    parts = list(client.chat(model=f"{MODEL}:latest", messages=QUESTION, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and len(parts) > 2
    assert "".join(p.message.content for p in parts) == reference["chat"].text
    assert_counters(parts[-1], reference["chat_prompt_len"], MAX_TOKENS, reference["chat"].finish_reason)


def test_generate_templated_raw_whole_and_streamed(server, client, reference):
    templated = client.generate(model=MODEL, prompt=QUESTION[0]["content"], system=SYSTEM, options=GREEDY)
    assert templated.response == reference["system"].text
    raw = client.generate(model=MODEL, prompt=RAW_PROMPT, raw=True, options=GREEDY)
    assert raw.response == reference["raw"].text
    parts = list(client.generate(model=MODEL, prompt=RAW_PROMPT, raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == reference["raw"].text and parts[-1].eval_count == MAX_TOKENS
    # Ollama streams unless told not to; an empty prompt only "loads" the model (ours is always loaded).
    body = {"model": MODEL, "prompt": RAW_PROMPT, "raw": True, "options": GREEDY}
    with httpx.stream("POST", server + "/api/generate", json=body, headers=AUTH, timeout=60) as resp:
        assert resp.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in resp.iter_lines() if line]
    assert len(lines) > 2 and lines[-1]["done"] and "".join(x["response"] for x in lines) == reference["raw"].text
    loaded = client.generate(model=MODEL, prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_options_are_honoured(client, reference):
    ref = reference["chat"].text
    short = client.chat(model=MODEL, messages=QUESTION, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    stop = ref.split()[2]
    stopped = client.chat(model=MODEL, messages=QUESTION, options=GREEDY | {"stop": [stop]})
    assert stopped.message.content == ref[: ref.index(stop)] and stopped.done_reason == "stop"
    # top_k 1 keeps only the most likely token: greedy whatever the temperature
    top1 = client.chat(
        model=MODEL, messages=QUESTION, options={"temperature": 1.0, "top_k": 1, "num_predict": MAX_TOKENS}
    )
    assert top1.message.content == ref
    seeded = {"temperature": 1.5, "seed": 7, "num_predict": 24, "num_ctx": CONTEXT, "mirostat": 0}
    first, again = (client.chat(model=MODEL, messages=QUESTION, options=seeded) for _ in range(2))
    assert first.message.content == again.message.content
    neutral = {"repeat_penalty": 1.0, "repeat_last_n": -1, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert client.chat(model=MODEL, messages=QUESTION, options=GREEDY | neutral, keep_alive="5m").message.content == ref


def test_logprobs_equal_the_openai_routes_whole_and_streamed(server, client, reference):
    ours = client.chat(model=MODEL, messages=QUESTION, options=GREEDY, logprobs=True, top_logprobs=3)
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": MAX_TOKENS}
    body |= {"logprobs": True, "top_logprobs": 3}
    theirs = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    expected = theirs["choices"][0]["logprobs"]["content"]
    got = [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs]) for lp in ours.logprobs]
    tops = [[(t["token"], t["logprob"]) for t in e["top_logprobs"]] for e in expected]
    assert got == [(e["token"], e["logprob"], top) for e, top in zip(expected, tops, strict=True)]
    assert len(ours.logprobs) == len(reference["chat"].token_ids)  # one per sampled token, the EOS too
    assert "".join(lp.token for lp in ours.logprobs).startswith(reference["chat"].text)
    assert all(lp.top_logprobs[0].token == lp.token for lp in ours.logprobs)  # greedy: the top token was taken
    streamed = client.chat(model=MODEL, messages=QUESTION, options=GREEDY, logprobs=True, top_logprobs=3, stream=True)
    assert [lp for part in streamed for lp in part.logprobs or []] == list(ours.logprobs)


def test_format_json_and_schema_give_valid_json(client):
    ask = [{"role": "user", "content": "Describe a famous painter as JSON."}]
    sampled = {"temperature": 1.0, "seed": 7, "num_predict": 200}
    answer = client.chat(model=MODEL, messages=ask, format="json", options=sampled)
    assert answer.done_reason == "stop" and isinstance(json.loads(answer.message.content), dict)
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["capital", "country"],
        "additionalProperties": False,
    }
    streamed = list(
        client.generate(model=MODEL, prompt="Capital of France?", format=schema, stream=True, options=sampled)
    )
    assert streamed[-1].done_reason == "stop"
    jsonschema.validate(json.loads("".join(p.response for p in streamed)), schema)


def test_tags_show_ps_and_version_describe_the_served_model(server, client, engine):
    path = Path(str(engine.model_path))
    reader = gguf.GGUFReader(path)
    parameters = sum(math.prod(int(d) for d in t.shape) for t in reader.tensors)
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.size == path.stat().st_size
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    assert listed.details.quantization_level == "Q4_1" and listed.details.parameter_size == f"{parameters / 1e6:.2f}M"
    shown = client.show(f"{MODEL}:latest")
    assert shown.modelinfo["general.parameter_count"] == parameters
    assert shown.capabilities == ["completion", "tools", "embedding"]
    assert shown.modelinfo["llama.context_length"] == CONTEXT and shown.template == engine.tokenizer.chat_template
    (running,) = client.ps().models
    assert running.model == MODEL and running.context_length == CONTEXT and running.size_vram == 0
    assert running.expires_at.year == 9999
    assert httpx.get(server + "/api/version", headers=AUTH).json() == {"version": "0.12.6"}
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("llama3")
    assert missing.value.status_code == 404 and "llama3" in missing.value.error
    pull = httpx.post(server + "/api/pull", json={"model": "llama3"}, headers=AUTH)
    assert pull.status_code == 404 and "/api/chat" in pull.json()["error"]


def test_tool_calls_and_results_go_as_on_the_openai_route(server, client):
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    options = {"temperature": 0, "num_predict": 100}
    ours = client.chat(model=MODEL, messages=ask, tools=[WEATHER], options=options)
    body = {"model": MODEL, "messages": ask, "tools": [WEATHER], "temperature": 0, "max_tokens": 100}
    theirs = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    expected = theirs["choices"][0]["message"]
    calls = [(c.function.name, dict(c.function.arguments)) for c in ours.message.tool_calls or []]
    assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected["tool_calls"]]
    assert calls and ours.message.content == (expected["content"] or "")
    for _, arguments in calls:
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    streamed = list(client.chat(model=MODEL, messages=ask, tools=[WEATHER], options=options, stream=True))
    assert [p.message.tool_calls for p in streamed[:-1]] == [ours.message.tool_calls] and streamed[-1].done
    # the call and its result go back into the prompt as the /v1 route renders them (tool_name as the call id)
    result = {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}
    followed = client.chat(model=MODEL, messages=[*ask, ours.message, result], tools=[WEATHER], options=options)
    openai_call = {"id": "get_weather", "type": "function", "function": expected["tool_calls"][0]["function"]}
    v1_messages = [*ask, {"role": "assistant", "content": None, "tool_calls": [openai_call]}]
    v1_messages.append({"role": "tool", "content": result["content"], "tool_call_id": "get_weather"})
    body = {**body, "messages": v1_messages}
    theirs = httpx.post(server + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert followed.message.content == (theirs["choices"][0]["message"]["content"] or "")


def test_embed_and_the_older_embeddings_route_give_the_v1_vectors(server, client, engine):
    texts = ["The lighthouse keeper lit the lamp.", "Fog came in early."]
    ours = client.embed(model=MODEL, input=texts)
    body = {"model": MODEL, "input": texts, "encoding_format": "float"}
    theirs = httpx.post(server + "/v1/embeddings", json=body, headers=AUTH, timeout=60).json()
    assert [list(v) for v in ours.embeddings] == [d["embedding"] for d in theirs["data"]]
    assert ours.prompt_eval_count == theirs["usage"]["prompt_tokens"] == sum(len(engine.encode(t)) for t in texts)
    assert len(ours.embeddings[0]) == engine.runner.model.spec.hidden_size
    older = client.embeddings(model=f"{MODEL}:latest", prompt=texts[1])
    assert list(older.embedding) == theirs["data"][1]["embedding"]
    for extra, name in (
        ({"truncate": True}, "truncate"),
        ({"options": {"temperature": 0}}, "temperature"),
        ({"dimensions": 3}, "dimensions"),
        ({"input": [""]}, "input"),
        ({"input": [1, 2]}, "input"),
    ):
        refused = httpx.post(server + "/api/embed", json={"model": MODEL, "input": "hi"} | extra, headers=AUTH)
        assert refused.status_code == 400 and name in refused.json()["error"], (extra, refused.text)
