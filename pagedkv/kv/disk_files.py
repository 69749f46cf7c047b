"""The disk tier's directory: block files (format and checks) and the LRU size limit, shared by processes.

A block file is plain safetensors (never pickle): one tensor ``kv``, of the pool's dtype (float32 or
float16) and shape [2 (K, V), layers, block_size, kv_heads, head_dim], and in its metadata the format, the
engine's fingerprint, the block key, its parent's key and the sha256 of the tensor's bytes.
:func:`decode_block` checks all of them and the sizes before a byte is used: a truncated, corrupted or
misplaced file raises :class:`CorruptBlockFile`.

:class:`BlockDirectory` puts files in place atomically (a temporary file, then ``os.replace``: a reader sees
a whole file or none) and keeps the files' total under ``max_bytes``, making room before each rename by
deleting the least recently used files first (a file's mtime is its last use). Processes sharing the
directory serialize that bookkeeping on an ``flock``; the running total lives in the lock file and is
recounted from the directory every ``RESCAN_EVERY`` writes. No fsync: a crash may leave a torn file, which
the checksum catches.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor

from pagedkv.kv.disk_fingerprint import FORMAT
from pagedkv.kv.hashing import BlockKey
from pagedkv.model.checkpoint import SAFETENSORS_DTYPES

SUFFIX = ".safetensors"
LOCK_FILE = ".lock"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600  # a temporary file this old was left by a killed writer
RESCAN_EVERY = 64  # writes between recounts of the directory (other processes, deleted files, crashes)
LOW_WATER = 0.9  # eviction frees down to this share of max_bytes, so it runs once per many writes
MAX_HEADER = 64 << 10
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class CorruptBlockFile(ValueError):
    """A block file that must not be served; the message says what is wrong with it."""


def encode_block(kv: Tensor, fingerprint: str, key: BlockKey, parent: BlockKey | None) -> bytes:
    """A block file's bytes: ``kv`` (contiguous, the pool's dtype) and its metadata, checksum included."""
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "key": key.hex(),
        "parent": parent.hex() if parent is not None else "",
        "sha256": hashlib.sha256(memoryview(kv.numpy()).cast("B")).hexdigest(),
    }
    return save({"kv": kv}, metadata=meta)


def read_block_file(path: Path, block_bytes: int) -> bytearray:
    """A block file's bytes (no symlinks; at most a block and a header); FileNotFoundError if it is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CorruptBlockFile("is not a regular file")
        if info.st_size > block_bytes + MAX_HEADER:
            raise CorruptBlockFile(f"is {info.st_size} bytes, far more than a block's {block_bytes}")
        buffer = bytearray(info.st_size)
        if f.readinto(buffer) != info.st_size:
            raise CorruptBlockFile("shrank while being read")
    return buffer


def decode_block(
    buffer: bytearray, fingerprint: str, key: BlockKey, shape: tuple[int, ...], dtype: torch.dtype
) -> Tensor:
    """The K/V tensor in a block file's bytes (a view of ``buffer``), after checking header, sizes, checksum."""
    if len(buffer) < 8:
        raise CorruptBlockFile("is truncated (no header)")
    header_len = int.from_bytes(buffer[:8], "little")
    if header_len > len(buffer) - 8:
        raise CorruptBlockFile("is truncated (in its header)")
    try:
        header = json.loads(bytes(buffer[8 : 8 + header_len]))
        meta, entry = header["__metadata__"], header["kv"]
        begin, end = (int(x) for x in entry["data_offsets"])
        found, found_dtype, checksum = tuple(entry["shape"]), entry["dtype"], meta["sha256"]
        fields = (meta["format"], meta["fingerprint"], meta["key"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptBlockFile(f"has an unreadable header ({type(exc).__name__})") from exc
    if fields != (FORMAT, fingerprint, key.hex()):
        raise CorruptBlockFile("holds another block (format, fingerprint or key differ)")
    nbytes, name = dtype.itemsize * math.prod(shape), _SAFETENSORS_NAMES[dtype]
    if found_dtype != name or found != shape or end - begin != nbytes:
        raise CorruptBlockFile(f"holds a {found_dtype} tensor of shape {list(found)}, not {name} {list(shape)}")
    offset = 8 + header_len + begin
    if offset + nbytes != len(buffer):
        raise CorruptBlockFile(f"is {len(buffer)} bytes, not {offset + nbytes} (truncated?)")
    if hashlib.sha256(memoryview(buffer)[offset:]).hexdigest() != checksum:
        raise CorruptBlockFile("fails its checksum")
    return torch.frombuffer(buffer, dtype=dtype, offset=offset, count=math.prod(shape)).view(shape)


class BlockDirectory:
    """Block files in ``directory`` under ``max_bytes`` in all, least recently used deleted first."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the disk tier's size limit must be > 0 bytes, got {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        self.num_evictions = 0
        _prepare(directory)

    def put(self, name: str, blob: bytes) -> bool:
        """Write ``blob`` as file ``name``, atomically, after making room; False if it can never fit."""
        if len(blob) > self.max_bytes:
            return False
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            with self._exclusive() as lock_fd:
                total, writes = _read_total(lock_fd)
                if total is None or writes >= RESCAN_EVERY:
                    total, writes = sum(size for _, _, size in self.scan()), 0
                if total + len(blob) > self.max_bytes:
                    total, writes = self._evict(len(blob)), 0
                path = self.directory / name
                with contextlib.suppress(FileNotFoundError):
                    total -= path.stat().st_size  # replaced by identical bytes (another process wrote it)
                os.replace(tmp, path)
                set_mtime(path)
                _write_total(lock_fd, total + len(blob), writes + 1)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return True

    def scan(self) -> list[tuple[int, str, int]]:
        """(mtime_ns, name, size) of every block file in the directory."""
        entries = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        info = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(info.st_mode):
                            entries.append((info.st_mtime_ns, entry.name, info.st_size))
        return entries

    def _evict(self, need: int) -> int:
        """Delete least recently used files until ``need`` more bytes fit under LOW_WATER; the new total."""
        entries = sorted(self.scan())
        total = sum(size for _, _, size in entries)
        target = max(0, int(self.max_bytes * LOW_WATER) - need)
        for _, name, size in entries:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)
            total -= size
            self.num_evictions += 1
        return total

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[int]:
        """The directory's bookkeeping lock, shared with other processes (released if the holder dies)."""
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)


def set_mtime(path: Path) -> None:
    """Mark a file used now, in nanoseconds (file systems stamp writes with a coarse clock)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now), follow_symlinks=False)


def _prepare(directory: Path) -> None:
    """Create ``directory`` (mode 0o700) or check it: its files decide what the model answers, so one that
    another user can write is refused. Temporary files a killed writer left are deleted."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"kv_cache_dir {directory} is writable by other users (or not yours): whoever can write it decides "
            f"what the model answers. Use a directory of your own, or `chmod go-w {directory}`"
        )
    now = time.time()
    with os.scandir(directory) as it:
        for entry in it:
            if entry.name.startswith(TMP_PREFIX):
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)


def _read_total(fd: int) -> tuple[int | None, int]:
    """(bytes of block files, writes since the last recount), as kept in the lock file; None if unknown."""
    try:
        total, writes = os.pread(fd, 64, 0).split()
        return int(total), int(writes)
    except ValueError:
        return None, 0


def _write_total(fd: int, total: int, writes: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{total} {writes}\n".encode(), 0)
