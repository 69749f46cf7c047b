"""POST /v1/embeddings through the official ``openai`` client against a live server on the default model:
both encodings equal the offline ``LLM.embed`` vectors (which test_embeddings checks against HF), and bad
requests are 400s naming the field that leave nothing behind."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_server import build_app
from pagedkv.sampling_params import SamplingParams
from tests.live_server import live_server, wait_idle

pytestmark = pytest.mark.slow

MODEL = "smol"
TEXTS = ["The lighthouse keeper lit the lamp.", "Ships passed in the fog before noon, one after another."]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=256, num_threads=1))


@pytest.fixture(scope="module")
def app(engine):
    return build_app(engine, MODEL, limits=ServerLimits(max_prompts=4))


@pytest.fixture(scope="module")
def server(app):
    with live_server(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _offline(engine: LLMEngine, text: str, pooling: str = "last") -> np.ndarray:
    """The same vector from the engine directly (before the server's thread owns it: the module's first use)."""
    return np.asarray(_OFFLINE[(text, pooling)], dtype=np.float32)


_OFFLINE: dict[tuple[str, str], list[float]] = {}


@pytest.fixture(scope="module", autouse=True)
def offline_vectors(engine):
    for pooling in ("last", "mean"):
        for text in TEXTS:
            request_id = engine.add_request(prompt=text, params=SamplingParams(max_tokens=0, pooling=pooling))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id == request_id:
                        _OFFLINE[(text, pooling)] = out.embedding


def test_the_client_default_base64_and_float_give_the_offline_vectors(client, engine):
    default = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    for i, text in enumerate(TEXTS):
        expected = _offline(engine, text)
        assert default.data[i].index == i and len(default.data[i].embedding) == engine.runner.model.spec.hidden_size
        assert np.array_equal(np.asarray(default.data[i].embedding, dtype=np.float32), expected)
        assert np.array_equal(np.asarray(floats.data[i].embedding, dtype=np.float32), expected)
    ids = [engine.encode(t) for t in TEXTS]
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(len(i) for i in ids)


def test_token_id_inputs_and_mean_pooling(server, engine):
    ids = engine.encode(TEXTS[1])
    body = {"model": MODEL, "input": [ids], "pooling": "mean", "encoding_format": "base64"}
    answer = httpx.post(server + "/v1/embeddings", json=body, timeout=120).json()
    vector = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(vector, _offline(engine, TEXTS[1], "mean"))


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"dimensions": 64}, "dimensions"),
        ({"input": ["a"] * 5}, "input"),
        ({"input": [[1, 2], "x"]}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [list(range(300))]}, "input"),
        ({"encoding_format": "int8"}, "encoding_format"),
        ({"pooling": "max"}, "pooling"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, extra, param):
    body = {"model": MODEL, "input": "hello"} | extra
    response = httpx.post(server + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error.get("param") or "") + error["message"]


def test_unknown_model_is_404(server):
    response = httpx.post(server + "/v1/embeddings", json={"model": "other", "input": "hi"}, timeout=60)
    assert response.status_code == 404


def test_nothing_is_left_behind(app, client):
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and app.state.async_engine.num_in_flight == 0


def test_the_route_keeps_the_key_the_host_check_and_the_body_bound():
    """/v1/embeddings passes the same gate as every route: a fresh app with an API key on its own engine."""
    guarded = build_app(
        LLMEngine(EngineConfig(num_kv_blocks=32, max_model_len=128, num_threads=1)),
        MODEL,
        api_key="sk-embed",
        max_body_bytes=4096,
    )
    key = {"Authorization": "Bearer sk-embed"}
    body = {"model": MODEL, "input": "hello"}
    with live_server(guarded) as base_url, httpx.Client(base_url=base_url, timeout=60) as http:
        assert http.post("/v1/embeddings", json=body).status_code == 401
        assert http.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.post("/v1/embeddings", json=body, headers=key | {"Host": "evil.example"}).status_code == 421
        assert http.post("/v1/embeddings", content=b"[" * 5000, headers=key).status_code == 413
        assert len(http.post("/v1/embeddings", json=body, headers=key).json()["data"]) == 1
        assert wait_idle(guarded)["kv_blocks_used"] == 0
