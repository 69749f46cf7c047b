"""``GET /kv`` in a real headless Chromium, loaded while the server serves a burst of requests.

The page must draw, from the JSON it fetched itself, one square per block in its state's colour: the
screenshot's pixels are read back (tests/kv_map_pixels.py) and compared with the snapshot the page drew,
during the burst (when blocks are held and shared), and once the server is idle, with a ``/kv.json`` the
test fetched itself. The browser authenticates like a person would: the API key as HTTP Basic auth in
the URL. Chromium comes from Debian's packages (``make test-browser`` installs it); without it this test
is skipped.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.kv_page import KV_JSON_MAX_AGE_S
from pagedkv.entrypoints.server.openai_server import build_app
from tests.headless_chromium import chromium, find_chromium
from tests.kv_map_pixels import states_in
from tests.live_server import live_server, wait_idle
from tests.tiny_model import save_tiny_llama

BINARY = find_chromium()
pytestmark = pytest.mark.skipif(
    BINARY is None,
    reason="Chromium is not installed: `make test-browser` installs it (apt-get install chromium, Debian's package)",
)

KEY, BS, NUM_BLOCKS, WIDTH, HEIGHT = "browser-key", 4, 300, 1280, 1400
SYSTEM = " ".join(f"w{i}" for i in range(10, 10 + 6 * BS))  # six blocks every request shares


def burst(url: str, stop: threading.Event, errors: list[str], worker: int) -> None:
    """One client of the burst: requests with the shared prefix and its own question, until ``stop``."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        i = 0
        while not stop.is_set():
            question = " ".join(f"w{100 + (worker * 37 + i * 11 + j) % 400}" for j in range(9))
            body = {"model": "tiny", "prompt": f"{SYSTEM} {question}", "max_tokens": 24, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            if response.status_code != 200:
                errors.append(response.text)
            i += 1


def drawn_states(page) -> tuple[dict, list]:
    """The snapshot the page drew and the states read from the screenshot's grid, taken between two of its
    refreshes (retried if a refresh fell in between)."""
    for _ in range(20):
        before = page.evaluate("window.kvRefreshes")
        data, grid = page.evaluate("[window.kvLast, window.kvGrid]")
        image = page.screenshot()
        if page.evaluate("window.kvRefreshes") == before:
            step = grid["cell"] + grid["gap"]
            left, top = round(grid["left"]), round(grid["top"])
            rows = -(-data["num_blocks"] // grid["cols"])
            return data, states_in(image[top : top + rows * step, left : left + grid["cols"] * step], data["palette"])
    raise AssertionError("the page refreshed during every screenshot")


def test_the_kv_page_shows_the_blocks_the_json_says(tmp_path):
    tiny = str(save_tiny_llama(tmp_path / "tiny-llama"))
    config = EngineConfig(model=tiny, num_kv_blocks=NUM_BLOCKS, block_size=BS, max_model_len=96, num_threads=1)
    app = build_app(LLMEngine(config), "tiny", api_key=KEY)
    stop, errors = threading.Event(), []
    with live_server(app) as url:
        clients = [threading.Thread(target=burst, args=(url, stop, errors, w), daemon=True) for w in range(8)]
        for thread in clients:
            thread.start()
        try:
            page_url = url.replace("http://", f"http://viewer:{KEY}@") + "/kv"
            with chromium(BINARY, tmp_path / "profile") as page:
                page.open(page_url, WIDTH, HEIGHT)
                page.wait_for("window.kvRefreshes >= 1")
                deadline = time.monotonic() + 30
                while True:  # a refresh that caught the burst with blocks in use
                    data, states = drawn_states(page)
                    if data["counts"]["shared"] and data["counts"]["held"] or time.monotonic() > deadline:
                        break
                    time.sleep(0.3)
                assert data["counts"]["shared"] > 0 and data["counts"]["held"] > 0, "the burst was not seen"
                assert states == [b["state"] for b in data["blocks"]]
                root = data["prefix_tree"]["roots"][0]
                assert page.evaluate("document.querySelector('#tree li b').textContent") == f"{root['blocks']} blocks"
                page.call("Page.captureScreenshot", format="png")  # the screenshot during the burst works

                stop.set()
                for thread in clients:
                    thread.join(60)
                wait_idle(app)
                time.sleep(KV_JSON_MAX_AGE_S)  # a rendering from during the burst serves until then
                with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as client:
                    idle = client.get("/kv.json").json()
                page.wait_for(f"window.kvLast.time > {idle['time']}")
                data, states = drawn_states(page)
                assert [b["state"] for b in data["blocks"]] == [b["state"] for b in idle["blocks"]]
                assert states == [b["state"] for b in idle["blocks"]]
                assert idle["counts"]["cached"] > 0 and idle["counts"]["held"] == idle["counts"]["shared"] == 0
                assert page.evaluate("document.getElementById('status').className") == ""
        finally:
            stop.set()
            for thread in clients:
                thread.join(60)
    assert not errors
