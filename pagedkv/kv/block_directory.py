"""The disk tier's directory: where block files live, and the LRU size limit, shared by processes.

The tier writes or deletes only in its own subdirectory of ``kv_cache_dir`` (checked and made by
:func:`pagedkv.kv.cache_dir.prepare_directory`): the user's directory may hold anything, and none of it is the
tier's. There a block file is named ``<64 hex digits>.safetensors``, a temporary one ``.tmp-<16 hex digits>``;
nothing else is ever deleted, and only if it is a regular file. Every file is reached through a descriptor of
that subdirectory, opened once without following symlinks, so a name swapped for a symlink later leads nowhere
else; and only a regular file is ever opened, without blocking (``pagedkv.kv.disk_files.read_regular_file``).
Block files of the old layout, at the top of ``kv_cache_dir``, are neither used nor deleted: one warning says so.

:class:`BlockDirectory` puts files in place atomically (a temporary file, then ``os.replace``: a reader sees
a whole file or none) and keeps the files' total under ``max_bytes``, making room before each rename by
deleting the least recently used files first (a file's mtime is its last use). Processes sharing the
directory serialize that bookkeeping on an ``flock``; the running total lives in the lock file and is
recounted from the directory every ``RESCAN_EVERY`` writes, or at once if what the lock file holds is not a
plausible total. A lock file the tier cannot trust is refused (:class:`UntrustedFile`): no write happens
without the size limit. No fsync: a crash may leave a torn file, which the checksum catches.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import stat
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from pagedkv.kv.cache_dir import BLOCKS_DIR, LOCK_FILE, UntrustedFile, check_lock, prepare_directory
from pagedkv.kv.disk_files import file_kind, read_regular_file

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"
BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
TMP_PREFIX = ".tmp-"
TMP_NAME = re.compile(r"\.tmp-[0-9a-f]{16}")
STALE_TMP_S = 3600  # a temporary file this old was left by a killed writer
RESCAN_EVERY = 64  # writes between recounts of the directory (other processes, deleted files, crashes)
LOW_WATER = 0.9  # eviction frees down to this share of max_bytes, so it runs once per many writes


class BlockDirectory:
    """Block files in the tier's own subdirectory of ``root``, under ``max_bytes`` in all, least recently used
    deleted first. Only names of the tier's scheme are written or deleted, and only regular files deleted."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the disk tier's size limit must be > 0 bytes, got {max_bytes}")
        self.directory = prepare_directory(root)
        self.max_bytes = max_bytes
        self.num_evictions = 0
        self._fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        weakref.finalize(self, os.close, self._fd)
        self._warned_total = False
        self._remove_stale_temporaries()
        _warn_of_old_layout(self.directory.parent)

    def contains(self, name: str) -> bool:
        """Whether block file ``name`` is there (a regular file: anything else is no block)."""
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=self._fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def read(self, name: str, limit: int) -> bytearray:
        """Block file ``name``'s bytes (:func:`read_regular_file`)."""
        return read_regular_file(name, limit, self._fd)

    def touch(self, name: str) -> None:
        """Mark a file used now, in nanoseconds (file systems stamp writes with a coarse clock).

        Only a file the tier could have written: a regular file with one name. A hard link planted under a
        block's name is the user's file too, and touching it by name changed that file's mtime (a prefix hit
        in memory touches the block's file on disk, whatever is there now). So the file is opened (no
        symlink followed, no FIFO waited on), checked, and stamped through its descriptor.
        """
        now = time.time_ns()
        with contextlib.suppress(OSError):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self._fd)
            try:
                info = os.fstat(fd)
                if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                    os.utime(fd, ns=(now, now))
            finally:
                os.close(fd)

    def put(self, name: str, blob: bytes) -> bool:
        """Write ``blob`` as file ``name``, atomically, after making room; False if it can never fit."""
        if len(blob) > self.max_bytes:
            return False
        tmp = TMP_PREFIX + secrets.token_hex(8)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=self._fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            with self._exclusive() as lock_fd:
                total, writes = self._read_total(lock_fd)
                if total is None or writes >= RESCAN_EVERY:
                    total, writes = sum(size for _, _, size in self.scan()), 0
                if total + len(blob) > self.max_bytes:
                    total, writes = self._evict(len(blob)), 0
                total -= self._replaced_size(name)  # identical bytes another process wrote
                os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
                self.touch(name)
                _write_total(lock_fd, total + len(blob), writes + 1)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fd)
            raise
        return True

    def remove(self, name: str) -> bool:
        """Delete block file ``name`` if it is one of the tier's: a name of its scheme, a regular file."""
        if not BLOCK_NAME.fullmatch(name):
            return False
        try:
            if not stat.S_ISREG(os.stat(name, dir_fd=self._fd, follow_symlinks=False).st_mode):
                return False
            os.unlink(name, dir_fd=self._fd)
        except FileNotFoundError:
            return False
        return True

    def scan(self) -> list[tuple[int, str, int]]:
        """(mtime_ns, name, size) of every block file in the directory."""
        entries = []
        with os.scandir(self._fd) as it:
            for entry in it:
                if BLOCK_NAME.fullmatch(entry.name):
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
            if self.remove(name):
                self.num_evictions += 1
            total -= size
        return total

    def _replaced_size(self, name: str) -> int:
        """The size of the block file ``put`` is about to replace (0 if none); refuses to replace anything
        else, which someone else put under a block's name."""
        try:
            info = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFile(
                f"{self.directory / name} is {file_kind(info.st_mode)}, not a block file: the tier does not replace "
                "it, so that block is not written. Remove it"
            )
        return info.st_size

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[int]:
        """The directory's bookkeeping lock, shared with other processes (released if the holder dies)."""
        path = self.directory / LOCK_FILE
        with contextlib.suppress(FileNotFoundError):
            check_lock(os.stat(LOCK_FILE, dir_fd=self._fd, follow_symlinks=False), path)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(LOCK_FILE, flags, 0o600, dir_fd=self._fd)
        try:
            check_lock(os.fstat(fd), path)
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)

    def _read_total(self, fd: int) -> tuple[int | None, int]:
        """(bytes of block files, writes since the last recount), as kept in the lock file; None if unknown.

        A total that cannot be one (negative, not numbers, a write count past RESCAN_EVERY) is recounted,
        with a warning, rather than believed: a planted ``-1000000000000`` switched the size limit off.
        """
        raw = os.pread(fd, 64, 0)
        if not raw:
            return None, 0  # a new lock file
        try:
            total, writes = (int(x) for x in raw.split())
        except ValueError:
            total = writes = -1
        if total >= 0 and 0 <= writes <= RESCAN_EVERY:
            return total, writes
        if not self._warned_total:
            self._warned_total = True
            logger.warning(
                "kv_cache_dir: %s holds %r, not a size total the disk tier wrote; the directory is recounted "
                "instead (if this recurs, something else writes that file)",
                self.directory / LOCK_FILE,
                raw[:64],
            )
        return None, 0

    def _remove_stale_temporaries(self) -> None:
        """Delete the tier's temporary files that a killed writer left (its names only, regular files only)."""
        now = time.time()
        with os.scandir(self._fd) as it:
            for entry in it:
                if TMP_NAME.fullmatch(entry.name):
                    with contextlib.suppress(OSError):
                        info = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(info.st_mode) and now - info.st_mtime > STALE_TMP_S:
                            os.unlink(entry.name, dir_fd=self._fd)


def _warn_of_old_layout(root: Path) -> None:
    """Say once that block files of the old layout (at the top of ``root``) are no longer used, and that the
    tier leaves them alone: a file named like one may be the user's, so only the user may delete them."""
    with contextlib.suppress(OSError), os.scandir(root) as it:
        old = [e.name for e in it if BLOCK_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False)]
        if old:
            logger.warning(
                "kv_cache_dir %s holds %d block files of an older pagedkv at its top (e.g. %s); the disk tier "
                "now keeps its files in %s/ and neither uses nor deletes those: delete them if nothing else uses "
                "them",
                root,
                len(old),
                old[0],
                BLOCKS_DIR,
            )


def _write_total(fd: int, total: int, writes: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{total} {writes}\n".encode(), 0)
