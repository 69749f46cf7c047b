"""Hostile connections against a live server (issue 25, rows 1, 2 and 7), loopback only, bounded in time.

Sockets that never finished their headers held their descriptors forever (~20,000 used them all up);
4 MiB bodies parsed on the event loop, and ``/kv.json`` rendered there, froze every other client's
stream. Now unfinished requests are closed after the server's timeouts, connections past the caps are
refused at once, and a victim's stream moves on while large bodies are parsed or ``/kv.json`` is rendered
(an order of events: the parsing or rendering is held until the victim got more tokens).
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

import httpx
import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.cli import build_parser
from pagedkv.entrypoints.server import bodies as bodies_module
from pagedkv.entrypoints.server import connections, kv_page
from pagedkv.entrypoints.server.connections import ConnectionLimits, fit_fd_limit, uvicorn_options
from pagedkv.entrypoints.server.openai_server import build_app
from tests.live_server import live_server, wait_idle
from tests.victim_stream import VictimStream

LIMITS = ConnectionLimits(
    header_timeout_s=3.0,
    body_timeout_s=2.0,
    max_connections=96,
    max_connections_per_client=24,
    refusal_log_interval_s=60.0,
)
VICTIM = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
VICTIM_TOKENS = 160
PARTIAL_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"
REFUSALS_LOGGED = "refused or closed by the server's limits"


def test_serve_options_set_the_connection_limits():
    args = build_parser().parse_args(["serve", "--header-timeout-s", "4.5", "--max-connections-per-client", "7"])
    limits = ConnectionLimits.from_args(args)
    assert (limits.header_timeout_s, limits.max_connections_per_client) == (4.5, 7)
    assert limits.max_connections == ConnectionLimits().max_connections
    with pytest.raises(ValueError, match="body_timeout_s"):
        ConnectionLimits(body_timeout_s=0)


def test_the_connection_cap_fits_the_file_descriptor_limit(monkeypatch):
    """Past the hard limit, the cap shrinks: accept() must never be the one to run out of descriptors."""
    rlimit = [1024, 1500]
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _: tuple(rlimit))
    monkeypatch.setattr(connections.resource, "setrlimit", lambda _, limits: rlimit.__setitem__(0, limits[0]))
    assert fit_fd_limit(ConnectionLimits(max_connections=1000)).max_connections == 1000 and rlimit[0] == 1256
    assert fit_fd_limit(ConnectionLimits(max_connections=2000)).max_connections == 1500 - connections.FD_RESERVE
    assert rlimit[0] == 1500


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(num_kv_blocks=1024, max_model_len=1024, num_threads=1))
    options = uvicorn_options(LIMITS)
    app = build_app(engine, "smol")
    with live_server(app, **options) as base_url:
        yield app, base_url, options["http"].counter


def connect(base_url: str, source: str) -> socket.socket:
    """A raw connection to the server from the loopback address ``source`` (each is its own client)."""
    sock = socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), source_address=(source, 0))
    sock.settimeout(10)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def not_answered(sock: socket.socket) -> bool:
    """Whether the server has neither answered ``sock`` nor closed it yet (looked at without waiting)."""
    readable, _, _ = select.select([sock], [], [], 0)  # an answer's first byte, or the end once closed
    return not readable


def closed_by_server(sock: socket.socket) -> bool:
    """Sends one more header byte on ``sock``; whether the server has closed it instead."""
    try:
        sock.sendall(b"a")
    except OSError:
        return True
    return not not_answered(sock)


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there in time"
        time.sleep(0.02)


@pytest.mark.slow
def test_unfinished_requests_are_closed_and_health_stays_fast(server, caplog):
    _, base_url, counter = server
    with ExitStack() as stack:
        partial = [stack.enter_context(connect(base_url, "127.0.0.2")) for _ in range(20)]
        for sock in partial:
            sock.sendall(PARTIAL_HEADERS)
        no_body = stack.enter_context(connect(base_url, "127.0.0.3"))
        no_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        trickle = stack.enter_context(connect(base_url, "127.0.0.3"))
        trickle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        with httpx.Client(base_url=base_url, timeout=60) as client:
            for _ in range(5):
                assert client.get("/health").status_code == 200
                assert all(not_answered(sock) for sock in partial), "/health waited behind the unfinished requests"
        deadline = time.monotonic() + 10 * LIMITS.header_timeout_s  # only ends the test if it is never closed
        while not closed_by_server(trickle):  # a byte at a time: progress, no reprieve
            assert time.monotonic() < deadline, "a header sent a byte at a time kept its connection open"
            time.sleep(0.2)
        assert read_until_closed(no_body).startswith(b"HTTP/1.1 408 ")
        for sock in partial:
            assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
    wait_for(lambda: not counter.per_client)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records), "a timed-out body is no server error"


@pytest.mark.slow
def test_connections_past_the_caps_are_refused_at_once(server, caplog):
    _, base_url, counter = server
    caplog.set_level(logging.WARNING, logger="pagedkv.entrypoints.server.connections")
    per_client = LIMITS.max_connections_per_client
    with ExitStack() as stack:
        for _ in range(per_client):
            stack.enter_context(connect(base_url, "127.0.0.4"))
        for _ in range(30):
            with connect(base_url, "127.0.0.4") as over:
                assert read_until_closed(over).startswith(b"HTTP/1.1 429 ")
        wait_for(lambda: counter.total == per_client)
        sources = [f"127.0.1.{i}" for i in range(LIMITS.max_connections // per_client)]
        for i in range(LIMITS.max_connections - per_client):
            stack.enter_context(connect(base_url, sources[i // per_client]))
        with connect(base_url, "127.0.2.1") as over:
            assert read_until_closed(over).startswith(b"HTTP/1.1 503 ")
        assert counter.total == LIMITS.max_connections
    assert sum(REFUSALS_LOGGED in r.getMessage() for r in caplog.records) <= 1, "one line per refusal"
    wait_for(lambda: counter.total == 0)
    assert httpx.get(base_url + "/health").status_code == 200


def large_bodies_waiting_for(monkeypatch, victim: VictimStream, bodies: int, events: int) -> list[bool]:
    """Make the first ``bodies`` large bodies' parsing wait until ``victim`` got ``events`` more stream events;
    returns the list each appends whether they came. Parsed on the event loop, which delivers the stream, a
    body would wait for events that cannot come until it is parsed: an order of events, not a time."""
    validate = bodies_module.BodyParser.validate
    came: list[bool] = []

    def waiting(parser, raw: bytes, model):
        if len(raw) > 1_000_000 and len(came) < bodies:  # the attack's bodies, not the victim's
            came.append(victim.is_alive() and victim.got_more(events))
        return validate(parser, raw, model)

    monkeypatch.setattr(bodies_module.BodyParser, "validate", waiting)
    return came


@pytest.mark.slow
def test_large_bodies_do_not_stall_a_stream(server, monkeypatch):
    app, base_url, _ = server
    bodies = [  # ~3.5 MB each, within the 4 MiB cap. Two are more values than --max-json-values, refused before
        # parsing: 450k token ids, and ~1M tiny containers, whose parsing held the GIL 0.15-0.4 s. One is parsed
        # on the worker and refused after it (the prompt is too long)
        json.dumps({"prompt": list(range(450_000))}).encode(),
        json.dumps({"prompt": "hi", "max_tokens": 1, "user": [[{}] * 4000] * 250}).encode(),
        json.dumps({"prompt": "a, [b], {c} " * 300_000}).encode(),
    ]
    statuses: list[int] = []
    refusals: list[str] = []

    def attacker(source: str) -> None:
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(base_url=base_url, transport=transport, timeout=600) as client:
            for body in bodies:
                resp = client.post("/v1/completions", content=body)
                statuses.append(resp.status_code)
                refusals.append(resp.json()["error"]["message"])

    victim = VictimStream(base_url, VICTIM, VICTIM_TOKENS)
    came = large_bodies_waiting_for(monkeypatch, victim, bodies=4, events=2)
    victim.start()
    assert victim.decoding.wait(60)
    attackers = [threading.Thread(target=attacker, args=(f"127.0.3.{i}",)) for i in range(6)]
    for thread in attackers:
        thread.start()
    for thread in attackers:
        thread.join(600)
    assert came == [True] * 4, f"the victim's stream stopped while {came.count(False)} of 4 large bodies were read"
    victim.gaps()  # it finished, with its tokens
    assert sorted(statuses) == [400] * 6 + [413] * 12
    assert sum("(--max-json-values)" in message for message in refusals) == 12
    assert wait_idle(app)["kv_blocks_used"] == 0


def kv_json_crowd(base_url: str, requests: int, per_connection: int = 3) -> list[socket.socket]:
    """Connections that have sent ``requests`` requests for /kv.json in all, ``per_connection`` each and
    pipelined (the last one asks to close), from four client addresses (17 connections each for 200,
    within the caps): raw sockets, so that the clients cost this process little next to the server."""
    get = b"GET /kv.json HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    crowd = []
    for first in range(0, requests, per_connection):
        sock = connect(base_url, f"127.0.4.{len(crowd) % 4}")
        count = min(per_connection, requests - first)
        sock.sendall((get + b"\r\n") * (count - 1) + get + b"Connection: close\r\n\r\n")
        crowd.append(sock)
    return crowd


def renderings_waiting_for(monkeypatch, victim: VictimStream, renderings: int, events: int) -> list[bool]:
    """Make the first ``renderings`` renderings of /kv.json wait until ``victim`` got ``events`` more stream
    events; returns the list each appends whether they came (rendered on the event loop, they never would)."""
    render = kv_page.render_kv_json
    came: list[bool] = []

    def waiting(snapshot):
        if len(came) < renderings:
            came.append(victim.is_alive() and victim.got_more(events))
        return render(snapshot)

    monkeypatch.setattr(kv_page, "render_kv_json", waiting)
    return came


@pytest.mark.slow
def test_a_crowd_on_kv_json_does_not_stall_a_stream(server, monkeypatch):
    app, base_url, _ = server
    snapshots = []

    def counted(core):
        snapshots.append(time.monotonic())
        return read_engine(core)

    read_engine = kv_page.read_engine
    monkeypatch.setattr(kv_page, "read_engine", counted)
    victim = VictimStream(base_url, VICTIM, VICTIM_TOKENS)
    came = renderings_waiting_for(monkeypatch, victim, renderings=3, events=2)
    victim.start()
    assert victim.decoding.wait(60)
    started = time.monotonic()
    answers = 0
    for sock in kv_json_crowd(base_url, 200):
        with sock:
            answers += read_until_closed(sock).count(b"HTTP/1.1 200 OK")
    elapsed = time.monotonic() - started
    assert came and all(came), f"the victim's stream stopped during {came.count(False)} of {len(came)} renderings"
    victim.gaps()  # it finished, with its tokens
    assert answers == 200
    assert len(snapshots) <= elapsed / kv_page.KV_JSON_MAX_AGE_S + 2, "one rendering serves a whole refresh period"
    assert wait_idle(app)["kv_blocks_used"] == 0
