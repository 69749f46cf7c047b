"""Serve an app on a free loopback port from a thread, for tests that drive a live server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def live_server(app, **options) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 (a port chosen by the OS) until the block ends; yields the base URL.

    ``options``: more ``uvicorn.Config`` options (``connections.uvicorn_options`` for the server's limits)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, **options))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()


def wait_idle(app, timeout_s: float = 30.0) -> dict:
    """Wait until the engine holds no request and no block (aborts travel through the engine thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = app.state.async_engine.stats()
        busy = stats["kv_blocks_used"] or stats["num_requests_running"] or stats["num_requests_waiting"]
        if not busy and app.state.async_engine.num_in_flight == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def wait_healthy(proc, base_url: str, timeout_s: float = 120.0) -> None:
    """Wait until a ``pagedkv serve`` subprocess answers /health with 200 (failing if it exits or takes too long)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(base_url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
