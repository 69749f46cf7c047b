"""One HTTP request carried to an ASGI app in another process as plain data, and its response back.

Ray Serve passes requests between deployments as pickled Python objects, not HTTP. So the ingress packs a
request (method, path, headers, body) into a ``ForwardedRequest``, a replica runs it through the very app
that ``pagedkv serve`` serves (``build_app``), and ``run_asgi`` streams the app's ASGI messages back in
batches for the ingress to replay to the client. Every route, check, error body and event stream of the
one-process server thus holds behind the replicas too, with no second implementation of any of them.

A consumer that stops reading (the client left, so Ray cancels the stream) is a disconnect for the app:
it aborts the request and frees its KV blocks, as it does for a client of the one-process server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

from pagedkv.kv.hashing import BlockKey

# After a disconnect, how long the app may take to finish on its own before it is cancelled.
DISCONNECT_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """An HTTP request as data, plus what the routers match on (``routing_keys.RoutingKey``).

    ``prompt`` is named for Ray's ``PrefixCacheAffinityRouter``, which looks for a ``prompt`` attribute on
    the request's arguments; pagedkv's block-key router reads ``block_keys``.
    """

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    block_keys: tuple[BlockKey, ...] = ()
    prompt: str = ""


def _scope(request: ForwardedRequest) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": list(request.headers),
        "client": request.client,
        "server": None,
    }


def is_last(message: Message) -> bool:
    return message["type"] == "http.response.body" and not message.get("more_body", False)


async def run_asgi(
    app: ASGIApp, request: ForwardedRequest, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> AsyncIterator[list[Message]]:
    """Run ``request`` through ``app``; yield its response messages in batches (whatever is ready at once).

    ``extra_headers`` are added to the response's start message (the replica names itself there).
    """
    queue: asyncio.Queue[Message] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra_headers]}
        await queue.put(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))
    try:
        done = False
        while not done:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()  # the app returned (or raised) without finishing its response
                raise RuntimeError(f"{request.method} {request.path}: the app ended without a complete response")
            batch = [getter.result()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            done = is_last(batch[-1])
            yield batch
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
            task.cancel()
