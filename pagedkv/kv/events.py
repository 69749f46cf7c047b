"""KV cache events for external routers, in vLLM's format: which blocks this engine holds, as they change.

A KV-aware router (vLLM's examples, NVIDIA Dynamo, llm-d) keeps, per replica, the set of block hashes it
has cached, from three events: ``BlockStored`` (blocks got keys: their hashes, the parent's hash, their
token ids, the block size), ``BlockRemoved`` (keys evicted) and ``AllBlocksCleared`` (``reset_prefix_cache``).
The KV manager records them in order as it caches, loads from disk, evicts and resets; the engine publishes
what one step recorded as one ``KVEventBatch`` (``ts``, ``events``), like vLLM, to in-process subscribers
(``LLM.subscribe_kv_events``) and, with ``kv_events_endpoint``, on a ZMQ PUB socket (needs ``pyzmq``).

On the socket each batch is the multipart message vLLM's ``ZmqEventPublisher`` sends: ``topic`` (empty),
an 8-byte big-endian sequence number, and the batch as msgpack in msgspec's ``array_like`` layout --
``[ts, [event, ...]]`` with each event ``[tag, fields...]`` in the field order below -- which vLLM's
subscriber example and routers decode unchanged. Hashes are the prefix cache's 32-byte sha256 block keys
(vLLM's ``ExternalBlockHash`` is bytes or int). ``medium`` is ``"GPU"``: vLLM's name for the engine's own
block pool, whatever the device, so routers weigh our hits like a vLLM replica's. vLLM's replay socket
(resending missed batches by sequence number) is not implemented: a subscriber that misses a batch
should resynchronise on the next ``AllBlocksCleared`` or by restarting the engine.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedkv.kv.hashing import BlockKey

logger = logging.getLogger(__name__)

MEDIUM = "GPU"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockKey]
    parent_block_hash: BlockKey | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockKey]
    medium: str | None = MEDIUM


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)


def as_wire(batch: KVEventBatch) -> list:
    """The batch as msgspec encodes vLLM's structs (array_like, tagged by class name)."""
    return [batch.ts, [[type(e).__name__, *(getattr(e, f) for f in e.__slots__)] for e in batch.events]]


def packb(value: object) -> bytes:
    """msgpack of None, bool, int, float, str, bytes and lists: what a batch holds (no msgpack dependency)."""
    out: list[bytes] = []
    _pack(value, out)
    return b"".join(out)


def _pack(value: object, out: list[bytes]) -> None:
    if value is None:
        out.append(b"\xc0")
    elif isinstance(value, bool):
        out.append(b"\xc3" if value else b"\xc2")
    elif isinstance(value, int):
        if 0 <= value < 128:
            out.append(struct.pack("B", value))
        elif -32 <= value < 0:
            out.append(struct.pack("b", value))
        elif 0 <= value < 2**64:
            out.append(b"\xcf" + struct.pack(">Q", value))
        elif -(2**63) <= value < 0:
            out.append(b"\xd3" + struct.pack(">q", value))
        else:
            raise ValueError(f"integer {value} does not fit msgpack's 64 bits")
    elif isinstance(value, float):
        out.append(b"\xcb" + struct.pack(">d", value))
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out.append(bytes([0xA0 | len(data)]) if len(data) < 32 else b"\xdb" + struct.pack(">I", len(data)))
        out.append(data)
    elif isinstance(value, (bytes, bytearray)):
        out.append(b"\xc4" + bytes([len(value)]) if len(value) < 256 else b"\xc6" + struct.pack(">I", len(value)))
        out.append(bytes(value))
    elif isinstance(value, (list, tuple)):
        out.append(bytes([0x90 | len(value)]) if len(value) < 16 else b"\xdd" + struct.pack(">I", len(value)))
        for item in value:
            _pack(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} in a KV event")


class KVEventRecorder:
    """The events of the KV manager since the last ``take``, in the order they happened."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, keys: Sequence[BlockKey], parent: BlockKey | None, token_ids: Sequence[int]) -> None:
        if keys:
            self._events.append(BlockStored(list(keys), parent, list(token_ids), self.block_size))

    def removed(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            self._events.append(BlockRemoved(list(keys)))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


class KVEventPublisher:
    """Sends each step's events, as one batch, to the subscribers and the ZMQ socket (if any)."""

    def __init__(self, endpoint: str | None = None) -> None:
        self._subscribers: list[Callable[[KVEventBatch], None]] = []
        self._seq = 0
        self._socket = None
        self.endpoint = endpoint
        if endpoint is not None:
            try:
                import zmq
            except ImportError as exc:
                raise ImportError("kv_events_endpoint needs pyzmq: pip install 'pagedkv[events]'") from exc
            self._socket = zmq.Context.instance().socket(zmq.PUB)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(endpoint)
            self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, if "tcp://...:0"
            self._noblock = zmq.NOBLOCK
            self._again = zmq.Again

    def subscribe(self, callback: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Call ``callback(batch)`` on the engine thread after every step that changed the cache; returns
        the function that unsubscribes. Keep it short: it runs between steps."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        batch = KVEventBatch(time.time(), events)
        for callback in list(self._subscribers):
            try:
                callback(batch)
            except Exception:  # a subscriber's bug never stops the engine
                logger.exception("a KV event subscriber failed")
        if self._socket is not None:
            payload = packb(as_wire(batch))
            try:
                self._socket.send_multipart([b"", struct.pack(">q", self._seq), payload], flags=self._noblock)
            except self._again:
                logger.debug("KV event batch %d dropped: no room in the socket's queue", self._seq)
            self._seq += 1

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
