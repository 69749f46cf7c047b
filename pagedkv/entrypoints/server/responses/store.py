"""ResponseStore: the responses a later request may continue (``previous_response_id``) or read back.

In memory, bounded in entries and in bytes (``--max-stored-responses``, ``--max-stored-response-bytes``),
the least recently used response going first. Each entry keeps the conversation up to and including its
answer, as chat messages without the instructions (a continuation does not inherit those, as in OpenAI's
API), and the response object that ``GET /v1/responses/{id}`` returns; both as UTF-8 JSON, so the bytes
counted are the bytes held. A response made with ``store: false`` is not kept.

Entries belong to the credentials they were made with (a digest of the ``Authorization`` header): another
key's request gets "not found", exactly as for an id that never existed, so ids reveal nothing across keys.
With one ``--api-key`` (or none) every client shares the store, as they share everything else.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

logger = logging.getLogger(__name__)


def owner_of(request: Request) -> str:
    """Whose entries a request may see: a digest of its credentials (never the key itself)."""
    return hashlib.sha256(request.headers.get("authorization", "").encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str
    conversation_json: bytes  # the chat messages up to the answer, instructions left out
    response_json: bytes  # the response object

    @property
    def size(self) -> int:
        return len(self.conversation_json) + len(self.response_json)

    def conversation(self) -> list[dict[str, Any]]:
        return json.loads(self.conversation_json)


class ResponseStore:
    """Response id -> StoredResponse, least recently used first; touched only on the event loop."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, owner: str, conversation: list[dict[str, Any]], response_json: bytes) -> bool:
        """Keep a response, evicting the least recently used ones to make room; False if it alone is
        larger than the whole store (it is then not kept: a continuation of it gets "not found")."""
        entry = StoredResponse(owner, json.dumps(conversation, ensure_ascii=False).encode(), response_json)
        if entry.size > self.max_bytes:
            logger.warning(
                "%s is %d bytes, more than the store's %d: not stored", response_id, entry.size, self.max_bytes
            )
            return False
        self._drop(response_id)
        while self._entries and (len(self._entries) >= self.max_entries or self.bytes + entry.size > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = entry
        self.bytes += entry.size
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The entry, if it exists and belongs to ``owner``; a hit makes it the most recently used."""
        entry = self._entries.get(response_id)
        if entry is None or not hmac.compare_digest(entry.owner, owner):
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
