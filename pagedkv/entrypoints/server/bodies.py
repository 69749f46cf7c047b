"""Request bodies, bounded before they are built: the one parser every API's routes read their bodies with."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request

from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.protocol import APIError

BodyT = TypeVar("BodyT", bound=BaseModel)

PARSE_ON_LOOP_BYTES = 64 * 1024  # bodies up to this size parse in well under a millisecond
PARSE_WORKERS = 1  # large bodies parsed at once: see BodyParser


class BodyParser:
    """Request bodies, read on the event loop and parsed there if small, on a bounded worker pool if not.

    Parsing and checking a 4 MiB body took ~1.5 s on a loaded machine, even for one that is then refused;
    on the event loop, six clients sending such bodies cut another client's stream from 157 to 8 events a
    minute (issue 25, row 2). Off the loop, the checks are Python code that gives the GIL back every few
    milliseconds, so stream delivery goes on meanwhile; ``json.loads`` and pydantic are not, but they are
    the smaller part (~50 ms of a 4 MiB body). One worker, not more: the parsing competes with the engine
    thread for the cores and the GIL, and with two workers on a 2-core machine an engine step took 0.6 s
    instead of 15 ms, while with one a victim stream's largest gap stayed under 3x its median + 0.5 s.
    """

    def __init__(self, limits: ServerLimits, max_model_len: int) -> None:
        self.limits = limits
        self.max_model_len = max_model_len
        self.pool = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="pagedkv-parse")

    async def parse(self, request: Request, model: type[BodyT]) -> BodyT:
        try:
            raw = await request.body()
        except ClientDisconnect as exc:  # the client left, or the server's body timeout closed it
            raise APIError(499, "the client closed the connection", code="client_closed_request") from exc
        if len(raw) <= PARSE_ON_LOOP_BYTES:
            return self.validate(raw, model)
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.validate, raw, model)

    def validate(self, raw: bytes, model: type[BodyT]) -> BodyT:
        """The JSON body, bounded (values, shape, then the limited fields) before pydantic builds anything from it;
        its values are counted before ``json.loads`` builds them, which holds the GIL throughout."""
        self.limits.check_values(raw, self.max_model_len)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the body is not valid JSON: {str(exc)[:200]}") from exc
        self.limits.check_shape(body)
        self.limits.check(body, self.max_model_len)
        return model.model_validate(body)
