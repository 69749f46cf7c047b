"""`pagedkv serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one LLMEngine.

``build_app`` makes the app around an existing engine, so tests serve it without a subprocess;
``serve`` loads the engine from the CLI options and runs uvicorn. On SIGINT / SIGTERM the server refuses
new requests (503), gives those in flight ``GRACEFUL_SHUTDOWN_S`` to finish, aborts the rest (streams get
an error event and ``[DONE]``), stops the engine thread, lets uvicorn close the connections, and exits 0.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.engine.async_client import AsyncEngine
from pagedkv.engine.grammar_pool import GrammarPool
from pagedkv.engine.metrics import ServerMetrics
from pagedkv.entrypoints.server.bodies import BodyParser
from pagedkv.entrypoints.server.connections import ConnectionLimits, fit_fd_limit, uvicorn_options
from pagedkv.entrypoints.server.kv_page import KV_PATHS, KVAuthRequired, add_kv_routes, basic_auth_matches
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.ollama.api import add_ollama_routes
from pagedkv.entrypoints.server.ollama.protocol import is_ollama_path, ollama_error_body
from pagedkv.entrypoints.server.openai_routes import add_openai_routes
from pagedkv.entrypoints.server.protocol import APIError, echoed
from pagedkv.entrypoints.server.responses.api import add_responses_routes
from pagedkv.entrypoints.server.serving import ServingContext
from pagedkv.entrypoints.server.serving_tokenize import add_tokenize_routes
from pagedkv.entrypoints.server.tool_calls import template_supports_tools

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
GRACEFUL_SHUTDOWN_S = 5.0


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error in the API's own shape: Ollama's on its routes, OpenAI's elsewhere."""
    body = ollama_error_body(error) if is_ollama_path(path) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers())


def is_loopback(host: str) -> bool:
    """A name or address that only reaches this machine: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    """The host part of a Host header: ``name``, ``name:port``, ``[v6]`` or ``[v6]:port``."""
    if host_header.startswith("["):
        return host_header[: host_header.find("]") + 1]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class RequestGate:
    """Checks that need no parsing, before routing: the Host header, the API key and the body size.

    ``loopback_only``: the server listens on a loopback address, so a legitimate request names a loopback
    host; any other Host is a web page that rebound its own domain to 127.0.0.1 (DNS rebinding) to reach
    this server from a browser, and is refused. With an API key, every route but ``/health`` needs it.

    A pure ASGI middleware rather than ``@app.middleware("http")``: the latter wraps responses in a way
    that hides client disconnects from streaming responses, and those must abort their requests.
    """

    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics, loopback_only: bool
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.loopback_only = loopback_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        error = None
        host = headers.get("host")
        if self.loopback_only and host is not None and not is_loopback(_host_name(host)):
            error = APIError(
                421, f"this server answers only to loopback host names, not {echoed(host)}", code="misdirected_request"
            )
        if error is None and self.expected and scope["path"] != "/health":
            given = headers.get("authorization", "").encode()
            path = scope["path"]
            if not hmac.compare_digest(given, self.expected) and not basic_auth_matches(path, given, self.api_key):
                refusal = KVAuthRequired if path in KV_PATHS else APIError  # the KV page asks a browser for the key
                error = refusal(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
        length = headers.get("content-length", "")
        if error is None and length.isdigit() and int(length) > self.max_body_bytes:
            error = self._too_large()
        if error is not None:
            self.metrics.rejected.labels(status=str(error.status)).inc()
            await error_response(error, scope["path"])(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes", code="request_too_large")

    def _limited(self, receive: Receive) -> Receive:
        """Counts streamed (chunked) bodies that carry no Content-Length."""
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                # An HTTPException passes through FastAPI's body reading unchanged, reaching our handler.
                raise HTTPException(413, self._too_large().message)
            return message

        return limited


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    async def respond(request: Request, error: APIError) -> JSONResponse:
        if error.status != 499:  # the client left: nothing was refused
            metrics.rejected.labels(status=str(error.status)).inc()
        return error_response(error, request.url.path)

    async def on_validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        errors = exc.errors(include_url=False, include_input=False)
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = first.get("loc", ())
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
        error = APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)
        return await respond(request, error)

    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "request_too_large" if exc.status_code == 413 else None
        return await respond(request, APIError(exc.status_code, str(exc.detail), code=code))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return await respond(request, APIError(500, "internal server error", type="server_error"))

    app.add_exception_handler(APIError, respond)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def build_app(
    engine: LLMEngine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: ServerLimits | None = None,
    loopback_only: bool = True,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine``; the engine thread runs while the app's lifespan does.

    ``loopback_only``: refuse requests whose Host is not a loopback name (for a server bound to loopback).
    ``reasoning_parser``: split chat answers' thinking into ``reasoning_content`` (see ``reasoning``).
    """
    limits = limits or ServerLimits()
    model_name = served_model_name or Path(str(engine.model_path)).name
    grammars = GrammarPool(engine.grammars, limits.grammar_compile_threads, limits.grammar_compile_timeout_s)
    async_engine = AsyncEngine(engine, limits.max_queued_seqs, grammars)
    ctx = ServingContext(async_engine, model_name, limits, template_supports_tools(engine.tokenizer), reasoning_parser)
    bodies = BodyParser(limits, engine.max_model_len)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()
            bodies.pool.shutdown(wait=False)

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    app.state.async_engine = async_engine
    metrics = async_engine.metrics
    app.add_middleware(
        RequestGate, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics, loopback_only=loopback_only
    )
    _add_error_handlers(app, metrics)
    add_kv_routes(app, async_engine)  # GET /kv (the live KV map) and /kv.json
    add_openai_routes(app, ctx, bodies, engine)  # /health, /metrics, /v1/models, completions, chat, embeddings
    add_tokenize_routes(app, ctx, bodies, engine)  # /tokenize, /detokenize
    add_ollama_routes(app, ctx, bodies, engine)  # Ollama's API: /api/chat, /api/generate, /api/tags, ...
    add_responses_routes(app, ctx, bodies, engine)  # POST /v1/responses, GET and DELETE /v1/responses/{id}
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn, but on shutdown the app's requests end before uvicorn waits for open connections.

    Plain uvicorn would wait for a stream that is still generating until its graceful-shutdown timeout,
    then cancel it mid-response. Draining first (new requests get 503 meanwhile) lets short requests
    finish and ends the rest cleanly with an error event and ``[DONE]``.
    """

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.config.app.state.async_engine.shutdown(drain_s=GRACEFUL_SHUTDOWN_S)
        await super().shutdown(sockets=sockets)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn asks this every 0.1 s whether to exit: also once the engine thread has died."""
        if self.config.app.state.async_engine.failed and not self.should_exit:
            logger.critical("the engine thread died: shutting the server down (exit code 1)")
            self.should_exit = True
        return await super().on_tick(counter)


def serve(args: argparse.Namespace, engine_kwargs: dict) -> int:
    """Load the engine, serve until SIGINT / SIGTERM, and return 0 after a clean shutdown.

    Returns 1 if the engine thread died: the server stops accepting, ends every request with an error and
    exits, so that a supervisor (systemd, Kubernetes) restarts it rather than it answering 503 forever.
    """
    from pagedkv.config import EngineConfig
    from pagedkv.engine.async_client import load_engine

    engine = load_engine(EngineConfig(**engine_kwargs))  # on a thread that exits: see load_engine
    limits = ServerLimits.from_args(args)
    app = build_app(
        engine,
        args.served_model_name,
        args.api_key,
        limits=limits,
        loopback_only=is_loopback(args.host),
        reasoning_parser=args.reasoning_parser,
    )
    connections = fit_fd_limit(ConnectionLimits.from_args(args))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", **uvicorn_options(connections))
    server = DrainingServer(config)
    return run_server(server)


def run_server(server: DrainingServer) -> int:
    """Run uvicorn until a signal or the engine thread's death; the process exit code."""
    async_engine: AsyncEngine = server.config.app.state.async_engine
    # uvicorn re-raises the signal it handled once it has shut down; by then the shutdown was clean,
    # so a handler that ignores it lets us return 0 instead of dying of the signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started and not async_engine.failed else 1
