"""DiskTier: the prefix cache's full blocks on disk, so a restarted engine finds them (``LLM(kv_cache_dir=...)``).

One file per block, content-addressed: its name is ``sha256(fingerprint, block key)``, where the block key
is the prefix cache's hash chain (``pagedkv.kv.hashing``) and the fingerprint covers the model's content,
weight format, kernels, block size, versions and CPU (``pagedkv.kv.disk_fingerprint``). So a lookup is one
``stat`` of a computed name -- nothing to index at start, and what another process wrote is found at once --
and an engine with any other fingerprint never finds, let alone reads, another's blocks. The file format,
its checks and the size limit live in ``pagedkv.kv.disk_files``.

Loads run on the engine thread, when the KV manager admits a request (``KVCacheManager.load_from_disk``). A
file that fails its checks is reported in one warning, deleted -- the block is then computed and written
again -- and never served.

Writes: when the KV manager caches a block full of computed tokens, :meth:`store` copies its K/V out of the
pool on the engine thread (the pool may reuse the block in the next step; 0.15-0.18 ms for the default
model's 720 KiB block, in one ``torch.stack`` of small slices: stacking K, V, then the two took 2.7-26 ms, as
the big copy went multi-threaded) and a writer thread does the rest: checksum, serialize, write. A queue over
``MAX_QUEUED_BYTES`` drops the write rather than stall a step.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from pagedkv.kv.disk_files import (
    SUFFIX,
    BlockDirectory,
    CorruptBlockFile,
    decode_block,
    encode_block,
    read_block_file,
    set_mtime,
)
from pagedkv.kv.hashing import BlockKey

logger = logging.getLogger(__name__)

__all__ = ["SUFFIX", "CorruptBlockFile", "DiskTier"]

MAX_QUEUED_BYTES = 64 << 20  # K/V copies waiting for the writer; beyond this a write is dropped


class DiskTier:
    """Full blocks' K/V in ``directory``, at most ``max_bytes``; ``attach`` the pools before use."""

    def __init__(self, directory: str | os.PathLike, fingerprint: str, max_bytes: int) -> None:
        self.directory = Path(directory).expanduser()
        self.files = BlockDirectory(self.directory, max_bytes)
        self.fingerprint = fingerprint
        self._fp = bytes.fromhex(fingerprint)
        self._pools: list[tuple[Tensor, Tensor]] = []
        self._shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # names queued for the writer
        self._queued_bytes = 0
        self._warned: set[str] = set()
        self._closed = False
        self.counters = dict.fromkeys(
            ("disk_blocks_loaded", "disk_load_failures", "disk_blocks_written", "disk_writes_dropped"), 0
        )
        self.seconds = {"disk_load": 0.0, "disk_store_copy": 0.0, "disk_write": 0.0}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._run, name="pagedkv-disk-writer", daemon=True)
        self._writer.start()

    @property
    def max_bytes(self) -> int:
        return self.files.max_bytes

    def attach(self, kv_caches: Sequence[tuple[Tensor, Tensor]]) -> None:
        """The pools blocks are copied from and loaded into: per layer (k, v) [blocks, block_size, heads, dim]."""
        self._pools = list(kv_caches)
        k = self._pools[0][0]
        self._shape = (2, len(self._pools), *k.shape[1:])
        self._dtype = k.dtype  # in the fingerprint too: a file of another KV dtype is another engine's

    @property
    def block_bytes(self) -> int:
        return self._dtype.itemsize * math.prod(self._shape)

    def path(self, key: BlockKey) -> Path:
        """The file of the block cached under ``key`` (under this tier's fingerprint)."""
        return self.directory / (hashlib.sha256(self._fp + key).hexdigest() + SUFFIX)

    def contains(self, key: BlockKey) -> bool:
        return self.path(key).exists()

    # -- the engine thread --------------------------------------------------------------------------------

    def load(self, key: BlockKey, block_id: int) -> bool:
        """Read ``key``'s block into pool block ``block_id``; False (the pool untouched) if it is absent or bad."""
        if not self._pools:
            raise RuntimeError("DiskTier.attach() the KV pools before loading blocks")
        start = time.perf_counter()
        path = self.path(key)
        try:
            kv = self.decode(read_block_file(path, self.block_bytes), key)
        except FileNotFoundError:
            return False  # deleted since it was looked up (evicted by another process): a plain miss
        except (OSError, CorruptBlockFile) as exc:
            self._reject(path, str(exc))
            return False
        with torch.no_grad():
            for layer, (k_pool, v_pool) in enumerate(self._pools):
                k_pool[block_id].copy_(kv[0, layer])
                v_pool[block_id].copy_(kv[1, layer])
        set_mtime(path)
        self.counters["disk_blocks_loaded"] += 1
        self.seconds["disk_load"] += time.perf_counter() - start
        return True

    def store(self, key: BlockKey, parent: BlockKey | None, block_id: int) -> None:
        """Queue pool block ``block_id`` (cached under ``key``) for writing, unless it is on disk already."""
        path = self.path(key)
        name = path.name
        if name in self._pending or self._closed:
            return
        if path.exists():
            self._queue.put(("touch", [name]))  # computed again: used, so last to be evicted
            return
        if not self._pools:
            raise RuntimeError("DiskTier.attach() the KV pools before storing blocks")
        if self._queued_bytes + self.block_bytes > MAX_QUEUED_BYTES:
            self.counters["disk_writes_dropped"] += 1
            return
        start = time.perf_counter()
        with torch.no_grad():  # one stack of small slices: copying whole K and V again costs 10x (threads)
            kv = torch.stack([k[block_id] for k, _ in self._pools] + [v[block_id] for _, v in self._pools])
            kv = kv.view(self._shape)
        with self._lock:
            self._pending.add(name)
            self._queued_bytes += self.block_bytes
        self._queue.put(("write", (name, key, parent, kv)))
        self.seconds["disk_store_copy"] += time.perf_counter() - start

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark these blocks used now (a prefix hit in memory), so the disk keeps them longest."""
        if keys and not self._closed:
            self._queue.put(("touch", [self.path(k).name for k in keys]))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued so far is on disk; False if ``timeout`` passed first."""
        if not self._writer.is_alive():
            return True
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish the queued writes and stop the writer (idempotent); later stores are dropped, loads still work."""
        self._closed = True
        if self._writer.is_alive():
            self.flush(timeout)
            self._queue.put(None)
            self._writer.join(timeout)

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = dict(self.counters)
        stats["disk_evictions"] = self.files.num_evictions
        stats.update({f"{name}_ms": 1000 * s for name, s in self.seconds.items()})
        stats["disk_write_queue_bytes"] = self._queued_bytes
        return stats

    def decode(self, buffer: bytearray, key: BlockKey) -> Tensor:
        """The K/V tensor of a block file's bytes, after its checks (``disk_files.decode_block``)."""
        return decode_block(buffer, self.fingerprint, key, self._shape, self._dtype)

    def _reject(self, path: Path, reason: str) -> None:
        """One warning per bad file; delete it, so the block is computed and written again."""
        self.counters["disk_load_failures"] += 1
        if path.name not in self._warned:
            self._warned.add(path.name)
            logger.warning("kv_cache_dir: %s %s; not used (the block is computed again)", path, reason)
        with contextlib.suppress(OSError):
            path.unlink()

    # -- the writer thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, payload = item
            try:
                if kind == "write":
                    self._write(*payload)
                elif kind == "touch":
                    for name in payload:
                        set_mtime(self.directory / name)
                else:
                    payload.set()
            except Exception:  # a full disk, a vanished directory: the engine goes on without this block
                logger.exception("kv_cache_dir: writing to %s failed", self.directory)
            finally:
                if kind == "write":
                    with self._lock:
                        self._pending.discard(payload[0])
                        self._queued_bytes -= self.block_bytes

    def _write(self, name: str, key: BlockKey, parent: BlockKey | None, kv: Tensor) -> None:
        start = time.perf_counter()
        if self.files.put(name, encode_block(kv, self.fingerprint, key, parent)):
            self.counters["disk_blocks_written"] += 1
        else:
            self.counters["disk_writes_dropped"] += 1
        self.seconds["disk_write"] += time.perf_counter() - start
