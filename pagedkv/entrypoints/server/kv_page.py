"""``GET /kv`` (the live KV map, one self-contained HTML page) and ``GET /kv.json`` (its data).

The snapshot is taken on the engine thread between two steps (``AsyncEngine.inspect``), the only place
where the pool's ref counts, free queue and block tables agree with each other; it is a few list copies
there, and the JSON is built on a worker thread, so a page refreshing every second costs the engine
almost nothing. One rendering serves every request for ``KV_JSON_MAX_AGE_S`` (the page's refresh
period), so a crowd of clients costs no more than one page. The page loads nothing from elsewhere (a
Content-Security-Policy says so to the browser) and polls ``kv.json`` itself.

Auth is the API's: with an API key both routes need it. Browsers cannot send a Bearer header when they
open a page, so these two routes also take the key as HTTP Basic auth (any user name, the key as the
password) and ask for it with ``WWW-Authenticate``: the browser prompts once and resends it for the
page's own requests.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import time
from importlib import resources
from typing import TYPE_CHECKING

from starlette.responses import HTMLResponse, Response

from pagedkv.engine.core_thread import EngineStopped
from pagedkv.entrypoints.server.protocol import APIError
from pagedkv.kv.snapshot import KVSnapshot, read_engine, snapshot_json

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pagedkv.engine.async_client import AsyncEngine

KV_PATHS = ("/kv", "/kv.json")
SNAPSHOT_TIMEOUT_S = 30.0  # a long prefill step can hold the engine thread for seconds
KV_JSON_MAX_AGE_S = 1.0  # kv_page.html's REFRESH_MS: a page never sees a rendering older than its last
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:; base-uri 'none'; form-action 'none'"
)
NO_STORE = {"Cache-Control": "no-store"}

logger = logging.getLogger(__name__)


def add_kv_routes(app: FastAPI, engine: AsyncEngine) -> None:
    kv_json_body = KVJsonCache(engine)
    page = resources.files("pagedkv.entrypoints.server").joinpath("kv_page.html").read_text(encoding="utf-8")

    @app.get("/kv", include_in_schema=False)
    async def kv_page() -> HTMLResponse:
        return HTMLResponse(page, headers={**NO_STORE, "Content-Security-Policy": CONTENT_SECURITY_POLICY})

    @app.get("/kv.json")
    async def kv_json() -> Response:
        return Response(await kv_json_body.get(), media_type="application/json", headers=NO_STORE)


class KVJsonCache:
    """The body of ``/kv.json``, rendered at most once per ``KV_JSON_MAX_AGE_S``.

    Rendered per request, the ~340 KB JSON was built on the event loop, and 200 concurrent requests
    blocked it for ~9 s (issue 25, row 7). Now the snapshot is taken once on the engine thread, rendered
    to bytes on a worker thread, and every request that comes while that runs, or within the max age
    after, gets the same bytes. A failed rendering is not kept: the next request tries again.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.body = b""
        self.rendered_at = self.rendering_since = -KV_JSON_MAX_AGE_S  # monotonic times a snapshot was asked for
        self.rendering: asyncio.Future[bytes] | None = None

    async def get(self) -> bytes:
        if time.monotonic() - self.rendered_at < KV_JSON_MAX_AGE_S:
            return self.body
        if self.rendering is None:
            self.rendering_since = time.monotonic()
            self.rendering = asyncio.ensure_future(self._render())
            self.rendering.add_done_callback(self._rendered)
        return await asyncio.shield(self.rendering)  # a client that leaves cancels its wait, not the rendering

    def _rendered(self, rendering: asyncio.Future[bytes]) -> None:
        self.rendering = None
        if not rendering.cancelled() and rendering.exception() is None:
            self.body, self.rendered_at = rendering.result(), self.rendering_since

    async def _render(self) -> bytes:
        try:
            snapshot = await asyncio.wait_for(self.engine.inspect(read_engine), SNAPSHOT_TIMEOUT_S)
        except EngineStopped as exc:
            raise APIError(503, f"no KV map: {exc}", type="server_error") from exc
        except asyncio.TimeoutError as exc:
            raise APIError(503, "the engine did not pause between steps in time: retry", type="server_error") from exc
        except Exception as exc:  # what the snapshot raised on the engine thread, which logged it
            raise kv_map_failed() from exc
        try:
            return await asyncio.to_thread(render_kv_json, snapshot)
        except Exception as exc:  # a bug here fails this request alone, with the details in the log
            logger.exception("building the KV map failed")
            raise kv_map_failed() from exc


def render_kv_json(snapshot: KVSnapshot) -> bytes:
    """The snapshot as JSON bytes, as starlette's JSONResponse would write them."""
    body = snapshot_json(snapshot)
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def kv_map_failed() -> APIError:
    return APIError(500, "the KV map could not be built; the server log says why", type="server_error")


def basic_auth_matches(path: str, authorization: bytes, api_key: str | None) -> bool:
    """Whether a request for a KV route carries ``api_key`` as the password of HTTP Basic auth."""
    if api_key is None or path not in KV_PATHS or not authorization.startswith(b"Basic "):
        return False
    try:
        _, _, password = base64.b64decode(authorization[6:].strip(), validate=True).partition(b":")
    except ValueError:  # binascii.Error is one
        return False
    return hmac.compare_digest(password, api_key.encode())


class KVAuthRequired(APIError):
    """A 401 that asks a browser for the API key (HTTP Basic), for the KV routes."""

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "WWW-Authenticate": 'Basic realm="pagedkv", charset="UTF-8"'}
