"""The two Ray Serve deployments behind ``pagedkv serve --replicas N``: one ingress, N engine replicas.

Ray Serve's HTTP proxy hands every request to the ``Ingress``. It checks what needs no parsing (Host, API
key, body size: the same ``RequestGate`` as the one-process server), computes the request's routing key
(``routing_keys``) and calls the engine deployment through a handle. The handle's request router -- it runs
here, in the ingress -- picks the replica from that key. An ``EngineReplica`` runs the request through the
one-process server's own app (``build_app``, see ``forwarding``) and streams the response back, naming
itself in the ``x-pagedkv-replica`` header.

A replica whose process dies before it answered is retried on another (a request has no side effects until
it produces output); Ray Serve replaces the dead one. A replica whose engine thread died fails its health
check, and Ray Serve replaces it too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import anyio
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.engine.metrics import ServerMetrics
from pagedkv.entrypoints.replicas.forwarding import ForwardedRequest, run_asgi
from pagedkv.entrypoints.replicas.routing_keys import RoutingKeys
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_server import DEFAULT_MAX_BODY_BYTES, RequestGate, build_app, error_response
from pagedkv.entrypoints.server.protocol import APIError

logger = logging.getLogger(__name__)

REPLICA_HEADER = b"x-pagedkv-replica"
# Tries of one request on replicas that die before answering (each try goes to a live replica).
ATTEMPTS = 3
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def _log_like_serve() -> None:
    """pagedkv's warnings go where Ray Serve's own go: the replica's log file and the driver's console."""
    ours = logging.getLogger("pagedkv")
    for handler in logging.getLogger("ray.serve").handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)


class EngineReplica:
    """One LLMEngine behind the one-process server's app; requests arrive as ``ForwardedRequest``."""

    async def __init__(self, engine_kwargs: dict, served_model_name: str | None, limits: ServerLimits) -> None:
        from pagedkv.config import EngineConfig
        from pagedkv.engine.async_client import load_engine

        _log_like_serve()
        engine = load_engine(EngineConfig(**engine_kwargs))  # on a thread that exits: see load_engine
        # The ingress already checked the Host header and the API key; nothing else reaches this app.
        self._app = build_app(engine, served_model_name, limits=limits, loopback_only=False)
        self._async_engine = self._app.state.async_engine
        self._async_engine.start()
        self.name = serve.get_replica_context().replica_id.unique_id

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[list[Message]]:
        async for batch in run_asgi(self._app, request, [(REPLICA_HEADER, self.name.encode())]):
            yield batch

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if not self._async_engine.is_running:
            raise RuntimeError(f"replica {self.name}: the engine thread is not running")

    def record_routing_stats(self) -> dict[str, float]:
        """Ray Serve passes this to the router: the pool size bounds the router's memory of this replica."""
        return {"kv_blocks_total": self._async_engine.stats().get("kv_blocks_total", 0)}

    async def __del__(self) -> None:
        await self._async_engine.shutdown()


class ForwardedResponse(Response):
    """Replays a replica's response messages to the client; a disconnect or a stalled client ends it.

    A client that stops reading would otherwise hold the request on the replica until it finishes: each
    send gets ``stall_timeout_s`` (the one-process server's ``--stream-stall-timeout-s``).
    """

    def __init__(self, start: Message, messages: AsyncIterator[Message], stall_timeout_s: float) -> None:
        self.status_code = start["status"]
        self.raw_headers = list(start.get("headers", ()))
        self.background = None
        self._start = start
        self._messages = messages
        self._stall_timeout_s = stall_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def replay() -> None:
            try:
                with anyio.fail_after(self._stall_timeout_s):
                    await send(self._start)
                async for message in self._messages:
                    with anyio.fail_after(self._stall_timeout_s):
                        await send(message)
            except TimeoutError:
                logger.warning("%s: the client read nothing for %.0f s; aborted", scope["path"], self._stall_timeout_s)
            finally:
                tasks.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tasks.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(replay)
                tasks.start_soon(watch_disconnect)
        finally:
            await self._messages.aclose()


async def _messages(first: list[Message], stream: DeploymentResponseGenerator) -> AsyncIterator[Message]:
    """The response's messages after the start message; cancels the replica's request when closed early."""
    try:
        for message in first:
            yield message
        async for batch in stream:
            for message in batch:
                yield message
    finally:
        stream.cancel()


class Ingress:
    """The one deployment the HTTP proxy talks to: gate, routing key, then the engine replicas."""

    def __init__(
        self,
        engine: DeploymentHandle,
        model: str | None,
        block_size: int,
        routing_kind: str,
        api_key: str | None,
        loopback_only: bool,
        stall_timeout_s: float,
    ) -> None:
        _log_like_serve()
        self._engine = engine.options(stream=True)
        tokenizer = None
        if routing_kind != "none":
            from transformers import AutoTokenizer

            from pagedkv.model.loader import model_directory

            tokenizer = AutoTokenizer.from_pretrained(model_directory(model))
        self._keys = RoutingKeys(tokenizer, block_size, routing_kind)
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-routing")
        self._gate = {"api_key": api_key, "loopback_only": loopback_only}
        self._stall_timeout_s = stall_timeout_s

    def __serve_build_asgi_app__(self) -> ASGIApp:
        async def on_error(_: Request, exc: Exception) -> Response:
            if isinstance(exc, HTTPException):  # the gate's 413 for a streamed body
                code = "request_too_large" if exc.status_code == 413 else None
                exc = APIError(exc.status_code, str(exc.detail), code=code)
            assert isinstance(exc, APIError)
            return error_response(exc)

        app = Starlette(
            routes=[Route("/{path:path}", self._forward, methods=METHODS)],
            exception_handlers={HTTPException: on_error, APIError: on_error},
        )
        metrics = ServerMetrics(dict)  # only the gate's rejections; each replica serves its own /metrics
        app.add_middleware(RequestGate, max_body_bytes=DEFAULT_MAX_BODY_BYTES, metrics=metrics, **self._gate)
        return app

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        loop = asyncio.get_running_loop()
        key = await loop.run_in_executor(self._tokenizer_thread, self._keys.of, request.method, request.url.path, body)
        client = request.scope.get("client")
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in request.scope["headers"]),
            body=body,
            client=tuple(client) if client else None,
            block_keys=key.block_keys,
            prompt=key.text,
        )
        for attempt in range(1, ATTEMPTS + 1):
            stream = self._engine.forward.remote(forwarded)
            try:
                first = await stream.__anext__()
                break
            except (RayActorError, ActorUnavailableError) as exc:
                logger.warning("a replica died before answering (try %d of %d): %s", attempt, ATTEMPTS, exc)
                if attempt == ATTEMPTS:
                    message = "no engine replica could answer: try again"
                    raise APIError(503, message, type="server_error", retry_after=1) from exc
        return ForwardedResponse(first[0], _messages(first[1:], stream), self._stall_timeout_s)
