"""The cache report and the KV map through a live server: ``usage.cache_miss_reason``, ``GET /kv.json``,
``GET /kv`` (auth, self-containment) and ``pagedkv kv-map``; on a tiny random Llama, loopback only."""

from __future__ import annotations

import base64
import json
import re
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints import cli
from pagedkv.entrypoints.server import kv_page
from pagedkv.entrypoints.server.openai_server import build_app
from pagedkv.kv_map import render_kv_map
from tests.kv_map_pixels import find_cells
from tests.live_server import live_server, wait_idle
from tests.tiny_model import save_tiny_llama

KEY, BS, NUM_BLOCKS = "kv-test-key", 4, 48
AUTH = {"Authorization": f"Bearer {KEY}"}


def words(start: int, count: int) -> str:
    """A prompt of ``count`` tokens for the tiny model's word-level tokenizer (``w<id>``)."""
    return " ".join(f"w{i}" for i in range(start, start + count))


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    config = EngineConfig(model=tiny, num_kv_blocks=NUM_BLOCKS, block_size=BS, max_model_len=64, num_threads=1)
    app = build_app(LLMEngine(config), "tiny", api_key=KEY)
    with live_server(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        yield app, url, client


def complete(client: httpx.Client, prompt: str | list[str], **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0} | extra
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_usage_reports_the_cache_miss_reason(server):
    _, _, client = server
    prompt = words(10, 3 * BS + 1)
    first = complete(client, prompt)["usage"]
    assert (first["prompt_tokens_details"]["cached_tokens"], first["cache_miss_reason"]) == (0, "new")
    second = complete(client, prompt)["usage"]
    assert (second["prompt_tokens_details"]["cached_tokens"], second["cache_miss_reason"]) == (3 * BS, "hit")
    salted = complete(client, prompt, cache_salt="tenant-b")["usage"]
    assert (salted["prompt_tokens_details"]["cached_tokens"], salted["cache_miss_reason"]) == (0, "new")
    both = complete(client, [prompt, words(30, 2 * BS + 1)])["usage"]
    assert both["prompt_tokens_details"]["cached_tokens"] == 3 * BS and both["cache_miss_reason"] == "new"


def test_a_streamed_usage_chunk_carries_it_too(server):
    _, _, client = server
    prompt = words(40, 2 * BS)  # exactly two blocks: the second time, one is reused
    complete(client, prompt)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    usage = json.loads(events[-2])["usage"]
    assert (usage["prompt_tokens_details"]["cached_tokens"], usage["cache_miss_reason"]) == (BS, "last_token")


def test_kv_json_lists_every_block_consistently_with_the_counters(server):
    app, _, client = server
    complete(client, words(50, 2 * BS + 1))
    stats = wait_idle(app)
    time.sleep(kv_page.KV_JSON_MAX_AGE_S)  # a rendering from before the request went idle may serve until then
    data = client.get("/kv.json").json()
    assert data["num_blocks"] == NUM_BLOCKS == len(data["blocks"])
    assert [b["id"] for b in data["blocks"]] == list(range(NUM_BLOCKS))
    assert data["counts"]["held"] == data["counts"]["shared"] == 0, "idle: nobody holds a block"
    assert data["counts"]["cached"] == data["num_cached_free"] == stats["kv_blocks_cached"] > 0
    assert sum(data["counts"].values()) == NUM_BLOCKS
    for block in data["blocks"]:
        assert (block["key"] is not None) == (block["state"] == "cached")
        assert block["ref_count"] == 0 and block["requests"] == []
    keys = {b["key"] for b in data["blocks"] if b["key"]}
    assert any(b["parent"] in keys for b in data["blocks"]), "cached prompts chain their blocks"
    assert data["history"] and data["history"][-1]["queries"] == stats["prefix_cache_queries"]


def test_the_kv_routes_need_the_api_key(server):
    _, url, _ = server
    with httpx.Client(base_url=url, timeout=30) as anonymous:
        for path in ("/kv", "/kv.json"):
            refused = anonymous.get(path)
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"].startswith("Basic"), "a browser must be asked for the key"
            assert anonymous.get(path, headers=basic("anyone", "wrong")).status_code == 401
            assert anonymous.get(path, headers=basic("anyone", KEY)).status_code == 200
            assert anonymous.get(path, headers=AUTH).status_code == 200
        api = anonymous.get("/v1/models", headers=basic("anyone", KEY))
        assert api.status_code == 401 and "www-authenticate" not in api.headers, "the API itself takes Bearer only"


def test_the_page_is_self_contained(server):
    _, _, client = server
    page = client.get("/kv")
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text), "no external assets"
    assert "kv.json" in page.text


def test_kv_map_command_draws_the_server_pool(server, tmp_path, capsys):
    _, url, client = server
    output = tmp_path / "map.png"
    assert cli.main(["kv-map", "--server", url, "--output", str(output), "--api-key", KEY]) == 0
    assert capsys.readouterr().out.strip() == str(output)
    data = client.get("/kv.json").json()
    left, top, width, height = render_kv_map(data).kv_grid_box
    image = np.asarray(Image.open(output).convert("RGB"))
    assert len(find_cells(image[top : top + height, left : left + width])) == NUM_BLOCKS
    assert cli.main(["kv-map", "--server", url, "--output", str(tmp_path / "x.png")]) == 1, "no key: refused"


def test_a_failing_snapshot_fails_its_request_not_the_engine(server, monkeypatch):
    _, _, client = server

    def broken(core):
        raise RuntimeError("a bug in the KV map")

    monkeypatch.setattr(kv_page, "read_engine", broken)
    time.sleep(kv_page.KV_JSON_MAX_AGE_S)  # past what an earlier test's rendering may still serve
    failed = client.get("/kv.json")
    assert failed.status_code == 500 and "a bug" not in failed.text, "internals stay in the log"
    monkeypatch.undo()
    assert complete(client, words(60, 5))["choices"][0]["finish_reason"] == "length"
    assert client.get("/kv.json").status_code == 200
