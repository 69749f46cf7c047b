"""Connection limits for ``pagedkv serve``: read timeouts, caps on open connections, quiet refusals.

uvicorn closes a keep-alive connection that idles between requests (``timeout_keep_alive``) and h11 bounds
the size of a request's headers (16 KiB), but nothing bounds how long a client may take to send them, nor
how many connections may be open: ``limit_concurrency`` answers 503 only once a request's headers have
arrived, so a socket that never finishes them holds its file descriptor forever. ~20,000 such sockets (no
API key needed) used up the server's descriptors; new clients' ``/health`` timed out and the log grew
~5 MB/s (issue 25, row 1). So the server runs uvicorn's h11 protocol through a subclass that

- closes a connection whose request headers are not complete ``header_timeout_s`` after it opened (or
  after its previous response), and one whose body is not complete ``body_timeout_s`` after its headers;
- refuses a connection past ``max_connections`` open ones (503) or past ``max_connections_per_client``
  from one client address (429): the answer is written at once and the socket closed;
- logs refusals and timeouts as one summary line per ``refusal_log_interval_s``, not one line each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv.entrypoints.server.limits import CliLimits, option
from pagedkv.entrypoints.server.protocol import APIError

logger = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors kept for the model files, the disk tier, logs and threads


@dataclass(slots=True)
class ConnectionLimits(CliLimits):
    """How long a client may take to send a request, and how many connections may be open at once."""

    ARGUMENT_GROUP = "connections (each refusal or timeout closes the connection)"
    HELP_SHOWS_DEFAULT = True
    header_timeout_s: float = option(
        10.0, "seconds a client has to send a request's headers, from connecting or from its last response"
    )
    body_timeout_s: float = option(60.0, "seconds a client has to send a request's body once its headers arrived")
    keep_alive_timeout_s: float = option(5.0, "seconds an idle keep-alive connection stays open")
    max_connections: int = option(2048, "open connections; past it a new one gets 503 and is closed")
    max_connections_per_client: int = option(
        256, "open connections from one client address; past it a new one gets 429 and is closed"
    )
    refusal_log_interval_s: float = option(
        10.0, "seconds between log lines about refused or timed-out connections (each line counts them)"
    )


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` options that enforce ``limits`` (one fresh set of counters per server)."""
    return {"http": guarded_protocol(limits), "timeout_keep_alive": limits.keep_alive_timeout_s}


def fit_fd_limit(limits: ConnectionLimits) -> ConnectionLimits:
    """Raise the soft file-descriptor limit so ``max_connections`` fit beside ``FD_RESERVE`` others; where
    the hard limit does not allow that, lower ``max_connections`` instead (with a warning): the cap must
    refuse a connection before ``accept`` runs out of descriptors, or the cap protects nothing."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = limits.max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return limits
    fitted = max(1, soft - FD_RESERVE)
    logger.warning(
        "the file-descriptor limit is %d: at most %d connections, not %d", soft, fitted, limits.max_connections
    )
    return replace(limits, max_connections=fitted)


class RefusalLog:
    """Counts refused and timed-out connections; logs them as one line per ``interval_s`` at most.

    One line per event is what grew the log by ~5 MB/s under ~20,000 hostile sockets. The first event logs
    at once; later ones are counted and reported with the first event after the interval has passed.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self.next_report = 0.0

    def note(self, event: str) -> None:
        self.counts[event] += 1
        now = time.monotonic()
        if now >= self.next_report:
            summary = ", ".join(f"{count} {event}" for event, count in self.counts.most_common())
            logger.warning("connections refused or closed by the server's limits: %s", summary)
            self.counts.clear()
            self.next_report = now + self.interval_s


class ConnectionCounter:
    """Open connections, in all and per client address, for one server."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.total = 0
        self.per_client: Counter[str] = Counter()
        self.log = RefusalLog(limits.refusal_log_interval_s)
        busy = APIError(503, "too many open connections: retry", "server_overloaded", "server_overloaded", 1)
        self.server_full = _raw_response(busy)
        message = f"more than {limits.max_connections_per_client} open connections from your address"
        self.client_full = _raw_response(APIError(429, message, code="too_many_connections", retry_after=1))

    def admit(self, client: str) -> bytes | None:
        """Count a new connection from ``client``; or the raw answer that refuses it, counting nothing."""
        if self.total >= self.limits.max_connections:
            self.log.note("over --max-connections")
            return self.server_full
        if self.per_client[client] >= self.limits.max_connections_per_client:
            self.log.note(f"over --max-connections-per-client from {client}")
            return self.client_full
        self.total += 1
        self.per_client[client] += 1
        return None

    def release(self, client: str) -> None:
        self.total -= 1
        self.per_client[client] -= 1
        if not self.per_client[client]:
            del self.per_client[client]


def _raw_response(error: APIError) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written before any request was read."""
    body = json.dumps(error.body()).encode()
    head = f"HTTP/1.1 {error.status} {_REASONS[error.status]}\r\ncontent-type: application/json\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in error.headers().items())
    return f"{head}connection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


_REASONS = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}
REQUEST_TIMEOUT = _raw_response(APIError(408, "the request was not received in time", code="request_timeout"))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with ``ConnectionLimits``: a deadline for the headers, another for the body,
    and a connection count checked as each connection opens. Subclassed per server by ``guarded_protocol``."""

    limits: ClassVar[ConnectionLimits]
    counter: ClassVar[ConnectionCounter]
    _admitted = False
    _phase: str | None = None  # "headers" or "body": what the client owes, with a deadline; None: nothing
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._client = self.client[0] if self.client else ""
        refusal = self.counter.admit(self._client)
        if refusal is not None:
            transport.write(refusal)
            transport.close()
            return
        self._admitted = True
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        if self._admitted:
            self._admitted = False
            self.counter.release(self._client)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def _follow_request(self) -> None:
        """Start the deadline of what the client owes now (headers or body), once per phase."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase != self._phase:
            self._phase = phase
            seconds = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
            self._set_deadline(seconds if phase else None)

    def _set_deadline(self, seconds: float | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(seconds, self._timed_out) if seconds is not None else None

    def _timed_out(self) -> None:
        """408 unless a response is already under way (the app then learns of the disconnect), and close."""
        self._deadline = None
        self.counter.log.note(f"{self._phase} timeout")
        responding = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if not responding:
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` class with its own counters: uvicorn makes one protocol per connection."""
    attributes = {"limits": limits, "counter": ConnectionCounter(limits)}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attributes)
