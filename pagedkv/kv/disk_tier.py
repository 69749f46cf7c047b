"""DiskTier: the prefix cache's full blocks on disk, so a restarted engine finds them (``LLM(kv_cache_dir=...)``).

One file per block, content-addressed: its name is ``sha256(fingerprint, block key)``, where the block key
is the prefix cache's hash chain (``pagedkv.kv.hashing``) and the fingerprint covers the model's content,
weight format, kernels, block size, versions and CPU (``pagedkv.kv.disk_fingerprint``). So a lookup is one
``stat`` of a computed name -- nothing to index at start, and what another process wrote is found at once --
and an engine with any other fingerprint never finds, let alone reads, another's blocks. The file format
and its checks live in ``pagedkv.kv.disk_files``, the directory and its size limit in
``pagedkv.kv.block_directory``.

Loads run on the engine thread, when the KV manager admits a request (``KVCacheManager.load_from_disk``). A
file that fails to be read for *any* reason -- its checks, an I/O error, something planted under its name --
is reported in one warning and never served, and :meth:`load` returns False: the block is computed again, no
exception reaches the engine step, and the KV manager gets its block back. The file is deleted if it is the
tier's own (a regular file of its naming scheme in its subdirectory), so the block is written again.

Writes: when the KV manager caches a block full of computed tokens, :meth:`store` copies its K/V out of the
pool on the engine thread (the pool may reuse the block in the next step; 0.15-0.18 ms for the default
model's 720 KiB block, in one ``torch.stack`` of small slices: stacking K, V, then the two took 2.7-26 ms, as
the big copy went multi-threaded) and a writer thread does the rest: checksum, serialize, write. A queue over
``MAX_QUEUED_BYTES`` drops the write rather than stall a step. A write that fails (a full disk, a refused lock
file) is counted in ``disk_write_failures`` and logged once per cause, not once per block.
"""

from __future__ import annotations

import errno
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

from pagedkv.kv.block_directory import SUFFIX, BlockDirectory
from pagedkv.kv.disk_files import MAX_HEADER, CorruptBlockFile, decode_block, encode_block
from pagedkv.kv.hashing import BlockKey

logger = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 64 << 20  # K/V copies waiting for the writer; beyond this a write is dropped


class DiskTier:
    """Full blocks' K/V in ``directory`` (kv_cache_dir; the files go in its subdirectory ``BLOCKS_DIR``), at
    most ``max_bytes``; ``attach`` the pools before use."""

    def __init__(self, directory: str | os.PathLike, fingerprint: str, max_bytes: int) -> None:
        self.files = BlockDirectory(Path(directory), max_bytes)
        self.directory = self.files.directory
        self.fingerprint = fingerprint
        self._fp = bytes.fromhex(fingerprint)
        self._pools: list[tuple[Tensor, Tensor]] = []
        self._shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # names queued for the writer
        self._queued_bytes = 0
        self._warned: set[str] = set()  # files whose read failed (engine thread)
        self._failure_causes: set[tuple[str, int | None]] = set()  # of failed writes (writer thread)
        self._closed = False
        self.counters = dict.fromkeys(
            (
                "disk_blocks_loaded",
                "disk_load_failures",
                "disk_blocks_written",
                "disk_writes_dropped",
                "disk_write_failures",
            ),
            0,
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

    def name(self, key: BlockKey) -> str:
        """The file name of the block cached under ``key`` (under this tier's fingerprint)."""
        return hashlib.sha256(self._fp + key).hexdigest() + SUFFIX

    def path(self, key: BlockKey) -> Path:
        return self.directory / self.name(key)

    def contains(self, key: BlockKey) -> bool:
        return self.files.contains(self.name(key))

    # -- the engine thread --------------------------------------------------------------------------------

    def load(self, key: BlockKey, block_id: int) -> bool:
        """Read ``key``'s block into pool block ``block_id``; False (the pool untouched) if it is absent or bad."""
        if not self._pools:
            raise RuntimeError("DiskTier.attach() the KV pools before loading blocks")
        start = time.perf_counter()
        name = self.name(key)
        try:
            kv = self.decode(self.files.read(name, self.block_bytes + MAX_HEADER), key)
        except FileNotFoundError:
            return False  # deleted since it was looked up (evicted by another process): a plain miss
        except Exception as exc:  # whatever a file does, the engine step goes on: the block is computed
            self._reject(name, exc)
            return False
        with torch.no_grad():
            for layer, (k_pool, v_pool) in enumerate(self._pools):
                k_pool[block_id].copy_(kv[0, layer])
                v_pool[block_id].copy_(kv[1, layer])
        self.files.touch(name)
        self.counters["disk_blocks_loaded"] += 1
        self.seconds["disk_load"] += time.perf_counter() - start
        return True

    def store(self, key: BlockKey, parent: BlockKey | None, block_id: int) -> None:
        """Queue pool block ``block_id`` (cached under ``key``) for writing, unless it is on disk already."""
        name = self.name(key)
        if name in self._pending or self._closed:
            return
        if self.files.contains(name):
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
            self._queue.put(("touch", [self.name(k) for k in keys]))

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

    def _reject(self, name: str, exc: Exception) -> None:
        """One warning per bad file; delete it if it is the tier's own, so the block is written again."""
        self.counters["disk_load_failures"] += 1
        if name not in self._warned:
            self._warned.add(name)
            reason = str(exc) if isinstance(exc, CorruptBlockFile) else f"could not be read ({_cause_text(exc)})"
            logger.warning("kv_cache_dir: %s %s; not used (the block is computed again)", self.directory / name, reason)
        try:
            self.files.remove(name)
        except OSError as unlink_error:  # left in place: read and refused again, each time in a moment
            logger.debug("kv_cache_dir: could not delete %s: %s", self.directory / name, unlink_error)

    # -- the writer thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, payload = item
            try:
                if kind == "write":
                    self._write(*payload)
                elif kind == "touch":
                    for name in payload:
                        self.files.touch(name)
                else:
                    payload.set()
            except Exception as exc:  # a full disk, a refused lock file: the engine goes on without this block
                self._write_failed(exc)
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

    def _write_failed(self, exc: Exception) -> None:
        """Count a failed write; log the first of each cause (an errno, an exception type) only: a full disk
        fails every block, and a traceback per block buried the log."""
        self.counters["disk_write_failures"] += 1
        cause = (type(exc).__name__, getattr(exc, "errno", None))
        if cause not in self._failure_causes:
            self._failure_causes.add(cause)
            logger.warning(
                "kv_cache_dir: writing a block to %s failed (%s); the engine goes on without it. Further "
                "failures of this kind are counted in disk_write_failures, not logged",
                self.directory,
                _cause_text(exc),
            )


def _cause_text(exc: BaseException, limit: int = 300) -> str:
    """An exception in one line, errno name first (``ENOSPC: ...``), at most ``limit`` characters."""
    text = f"{errno.errorcode.get(getattr(exc, 'errno', None)) or type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
