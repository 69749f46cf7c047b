"""The KV map of a real run, and what drawing it costs the server.

    python benchmarks/kv_map.py [--num-kv-blocks 224] [--output-dir benchmarks/results] [--json]

Serves the default model on a loopback port, sends the chat workload (32 requests sharing a system prompt)
once, then the same questions under a second system prompt, all at once. While that second burst runs it
draws the map with ``pagedkv kv-map`` (``kv_map.png``) and, if Chromium is installed, screenshots the
``/kv`` page (``kv_page.png``). The pool is kept small so the picture shows every state: the burst's
shared prompt and its own blocks, the first round's prompts cached and being evicted, a few empty blocks.

Measured meanwhile: how long each ``/kv.json`` held the engine thread (the snapshot between two steps),
the request's whole latency, and the JSON's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints import cli
from pagedkv.entrypoints.server import kv_page
from pagedkv.entrypoints.server.openai_server import build_app

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "workloads" / "chat_shared_prefix.json"
SECOND_SYSTEM = (
    "You are a cheerful tour guide for the same coastal town. Answer every question as if you were leading "
    "a walking tour: mention the harbour, the lighthouse or the old market when it fits, keep it short, and "
    "end with a friendly suggestion for what to see next. "
) * 2


def start_server(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def ask_all(url: str, system: str, questions: list[str], max_tokens: int) -> list[threading.Thread]:
    """One thread per question, all at once (the burst)."""

    def ask(question: str) -> None:
        body = {
            "model": "smol",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status()

    threads = [threading.Thread(target=ask, args=(q,), daemon=True) for q in questions]
    for thread in threads:
        thread.start()
    return threads


def screenshot_page(url: str, path: Path) -> bool:
    """The /kv page as Chromium draws it (after its first fetch of kv.json); False without Chromium."""
    binary = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if binary is None:
        return False
    args = [binary, "--headless", "--disable-gpu", "--hide-scrollbars", f"--screenshot={path}"]
    args += ["--window-size=1280,1000", "--virtual-time-budget=4000", f"{url}/kv"]
    if os.geteuid() == 0:
        args.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root
    subprocess.run(args, check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path.exists()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-kv-blocks", type=int, default=224)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    workload = json.loads(WORKLOAD.read_text())

    snapshot_ms: list[float] = []
    read_engine = kv_page.read_engine

    def timed_read(core):
        start = time.perf_counter()
        try:
            return read_engine(core)
        finally:
            snapshot_ms.append(1e3 * (time.perf_counter() - start))

    kv_page.read_engine = timed_read  # the route looks it up at call time
    engine = LLMEngine(EngineConfig(num_kv_blocks=args.num_kv_blocks, num_threads=2))
    server, thread, url = start_server(build_app(engine, "smol"))
    try:
        for t in ask_all(url, workload["system"], workload["questions"], workload["max_new_tokens"]):
            t.join()
        burst = ask_all(url, SECOND_SYSTEM, workload["questions"], workload["max_new_tokens"])
        latency_ms, sizes = [], []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the burst decodes and evicts the first round's blocks
            start = time.perf_counter()
            response = httpx.get(f"{url}/kv.json", timeout=60)
            latency_ms.append(1e3 * (time.perf_counter() - start))
            sizes.append(len(response.content))
            data = response.json()
            if data["counters"]["num_requests_running"] >= 16 and data["counters"]["evictions"]:
                break
            time.sleep(0.2)
        cli.main(["kv-map", "--server", url, "--output", str(args.output_dir / "kv_map.png")])
        page = screenshot_page(url, args.output_dir / "kv_page.png")
        for t in burst:
            t.join()
        final = httpx.get(f"{url}/kv.json", timeout=60).json()
    finally:
        server.should_exit = True
        thread.join(30)
    result = {
        "num_blocks": args.num_kv_blocks,
        "kv_json_engine_pause_ms_median": round(statistics.median(snapshot_ms), 2),
        "kv_json_engine_pause_ms_max": round(max(snapshot_ms), 2),
        "kv_json_latency_ms_median": round(statistics.median(latency_ms), 1),
        "kv_json_bytes": max(sizes),
        "requests_in_burst": len(workload["questions"]),
        "evictions": final["counters"]["evictions"],
        "hit_rate": round(final["counters"]["prefix_cache_hit_rate"], 3),
        "page_screenshot": page,
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
