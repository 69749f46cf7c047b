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

The socket has no authentication, and ``BlockStored`` carries the prompts' token ids, so whoever can connect
reads every prompt. ``check_endpoint`` therefore refuses, before the model loads, any endpoint but a loopback
TCP address or an IPC socket in a directory that others cannot write (an abstract ``ipc://@name`` has no
permissions at all), unless ``kv_events_allow_remote`` says the exposure is intended; the publisher binds an
IPC socket owner-only and checks the file after the bind. And a request with a ``cache_salt`` (a tenant that
asked for its own cache) never puts token ids in an event: its ``BlockStored`` has the block hashes, which
a router needs to route, and ``token_ids`` empty (``Request.event_token_ids``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedkv.kv.hashing import BlockKey

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
ALLOW_OPTION = "kv_events_allow_remote"
_HOW = (
    "use tcp://127.0.0.1:PORT, tcp://[::1]:PORT, tcp://localhost:PORT or ipc:///PATH in a directory only you can "
    f"write, or set {ALLOW_OPTION}=True (--kv-events-allow-remote) to publish every prompt's token ids to "
    "whoever can connect"
)


def check_endpoint(endpoint: str, allow_remote: bool) -> None:
    """Refuse an endpoint that would let other users or machines read the prompts' token ids; ValueError
    naming the option and what to change. Runs before the model loads, so a bad one fails in a moment."""
    if allow_remote:
        return
    if endpoint.startswith("tcp://"):
        host = _tcp_host(endpoint)
        if host is None or not _is_loopback(host):
            raise ValueError(f"kv_events_endpoint {endpoint!r} is not a loopback address: {_HOW}")
    elif endpoint.startswith("ipc://"):
        _check_ipc_directory(endpoint, endpoint.removeprefix("ipc://"))
    else:
        raise ValueError(f"kv_events_endpoint {endpoint!r}: only tcp:// and ipc:// endpoints are checked; {_HOW}")


def _tcp_host(endpoint: str) -> str | None:
    """The host of ``tcp://HOST:PORT`` (brackets kept off an IPv6 address); None for ZMQ's other forms
    (``tcp://IFACE;HOST:PORT``, a missing port), which are not checked."""
    address = endpoint.removeprefix("tcp://")
    if ";" in address or ":" not in address:
        return None
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_loopback(host: str) -> bool:
    """``localhost`` or a literal loopback address; any other name could resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_ipc_directory(endpoint: str, path: str) -> None:
    """An IPC socket's directory must be this user's (or root's) and writable by no one else, unless it is
    sticky like /tmp: elsewhere another user could swap the socket file. The socket itself is made
    owner-only by ``KVEventPublisher``."""
    if path.startswith("@") or path in ("", "*"):
        raise ValueError(
            f"kv_events_endpoint {endpoint!r}: an abstract or wildcard IPC name has no permissions; {_HOW}"
        )
    directory = os.path.dirname(os.path.abspath(path))
    try:
        info = os.stat(directory)
    except OSError as exc:
        raise ValueError(
            f"kv_events_endpoint {endpoint!r}: its directory {directory} is unusable ({exc}); {_HOW}"
        ) from exc
    if info.st_uid not in (os.geteuid(), 0):
        raise ValueError(f"kv_events_endpoint {endpoint!r}: its directory {directory} belongs to another user; {_HOW}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise ValueError(
            f"kv_events_endpoint {endpoint!r}: others can write its directory {directory} "
            f"(mode {stat.S_IMODE(info.st_mode):o}); {_HOW}"
        )


def _secure_bound_endpoint(endpoint: str) -> None:
    """After the bind: an IPC socket file becomes mode 0600 and must be a socket of this user's; a TCP
    endpoint must have resolved to a loopback address. ValueError otherwise."""
    if endpoint.startswith("tcp://"):
        host = _tcp_host(endpoint)
        if host is None or not _is_loopback(host):
            raise ValueError(f"kv_events_endpoint bound to {endpoint!r}, which is not a loopback address: {_HOW}")
        return
    path = endpoint.removeprefix("ipc://")
    try:
        info = os.lstat(path)
        if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid():
            os.chmod(path, 0o600)  # a socket, not a symlink: chmod acts on this very file
            info = os.lstat(path)
    except OSError as exc:
        raise ValueError(f"kv_events_endpoint {endpoint!r}: the socket file is unusable ({exc}); {_HOW}") from exc
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ValueError(f"kv_events_endpoint {endpoint!r}: the socket file could not be made owner-only; {_HOW}")


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
    """Sends each step's events, as one batch, to the subscribers and the ZMQ socket (if any).

    ``allow_remote``: bind ``endpoint`` as given (see ``check_endpoint``); otherwise an IPC socket is created
    under umask 077 (no moment with others able to connect) and checked owner-only after the bind."""

    def __init__(self, endpoint: str | None = None, allow_remote: bool = False) -> None:
        self._subscribers: list[Callable[[KVEventBatch], None]] = []
        self._seq = 0
        self._socket = None
        self.endpoint = endpoint
        if endpoint is not None:
            try:
                import zmq
            except ImportError as exc:
                raise ImportError("kv_events_endpoint needs pyzmq: pip install 'pagedkv[events]'") from exc
            check_endpoint(endpoint, allow_remote)
            self._socket = zmq.Context.instance().socket(zmq.PUB)
            self._socket.setsockopt(zmq.LINGER, 0)
            if endpoint.startswith("tcp://") and ":" in (_tcp_host(endpoint) or ""):
                self._socket.setsockopt(zmq.IPV6, 1)  # ZMQ binds an IPv6 address only when told to
            umask = os.umask(0o077)  # process-wide for this moment: files made meanwhile are only more private
            try:
                self._socket.bind(endpoint)
            finally:
                os.umask(umask)
            self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, if "tcp://...:0"
            if not allow_remote:
                try:
                    _secure_bound_endpoint(self.endpoint)
                except ValueError:
                    self.close()
                    raise
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
