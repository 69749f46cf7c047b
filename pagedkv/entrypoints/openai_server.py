"""`pagedkv serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one LLMEngine.

``build_app`` makes the app around an existing engine, so tests serve it without a subprocess;
``serve`` loads the engine from the CLI options and runs uvicorn. On SIGINT / SIGTERM the server refuses
new requests (503), gives those in flight ``GRACEFUL_SHUTDOWN_S`` to finish, aborts the rest (streams get
an error event and ``[DONE]``), stops the engine thread, lets uvicorn close the connections, and exits 0.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.entrypoints.async_engine import AsyncEngine
from pagedkv.entrypoints.protocol import APIError, ChatCompletionRequest, CompletionRequest
from pagedkv.entrypoints.responses import ModelCard, ModelList
from pagedkv.entrypoints.server_metrics import ServerMetrics
from pagedkv.entrypoints.serving import ServingContext
from pagedkv.entrypoints.serving_chat import create_chat_completion
from pagedkv.entrypoints.serving_completions import create_completion

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
GRACEFUL_SHUTDOWN_S = 5.0


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class RequestGate:
    """Checks that need no parsing, before routing: the API key on /v1 routes and the body size.

    A pure ASGI middleware rather than ``@app.middleware("http")``: the latter wraps responses in a way
    that hides client disconnects from streaming responses, and those must abort their requests.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        error = None
        if self.expected and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                error = APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
        length = headers.get("content-length", "")
        if error is None and length.isdigit() and int(length) > self.max_body_bytes:
            error = self._too_large()
        if error is not None:
            self.metrics.rejected.labels(status=str(error.status)).inc()
            await error_response(error)(scope, receive, send)
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


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def respond(error: APIError) -> JSONResponse:
        if error.status != 499:  # the client left: nothing was refused
            metrics.rejected.labels(status=str(error.status)).inc()
        return error_response(error)

    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(_validation_error(exc))

    async def on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = "request_too_large" if exc.status_code == 413 else None
        return respond(APIError(exc.status_code, str(exc.detail), code=code))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return respond(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def build_app(
    engine: LLMEngine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine``; the engine thread runs while the app's lifespan does."""
    model_name = served_model_name or Path(str(engine.model_path)).name
    async_engine = AsyncEngine(engine, max_queued_requests)
    metrics = async_engine.metrics
    ctx = ServingContext(async_engine, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    _add_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=model_name, root=str(engine.model_path), max_model_len=engine.max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

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


def serve(args: argparse.Namespace, engine_kwargs: dict) -> int:
    """Load the engine, serve until SIGINT / SIGTERM, and return 0 after a clean shutdown."""
    from pagedkv.config import EngineConfig
    from pagedkv.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(**engine_kwargs))
    app = build_app(engine, args.served_model_name, args.api_key, args.max_queued_requests)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    # uvicorn re-raises the signal it handled once it has shut down; by then the shutdown was clean,
    # so a handler that ignores it lets us return 0 instead of dying of the signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
