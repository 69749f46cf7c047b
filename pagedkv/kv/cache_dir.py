"""``kv_cache_dir``'s checks: whether the disk tier may trust a directory before it writes a byte there.

Whoever can write the tier's directory decides what the model answers, so :func:`prepare_directory` accepts
only a real directory of this user's that others cannot write, makes the tier's own subdirectory in it
(``pagedkv-kv-blocks/``, where alone the tier writes), and refuses a lock file it cannot trust to keep the
size total (:func:`check_lock`). Every refusal is an :class:`UntrustedFile` or a PermissionError naming the
path and what to change. The files inside: ``pagedkv.kv.block_directory``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from pagedkv.kv.disk_files import file_kind

BLOCKS_DIR = "pagedkv-kv-blocks"  # the tier's own subdirectory of kv_cache_dir: it writes nowhere else
LOCK_FILE = ".lock"


class UntrustedFile(PermissionError):
    """A file or directory the tier refuses to use; the message names it and says what to change."""


def prepare_directory(root: str | Path) -> Path:
    """Check ``root`` (``kv_cache_dir``) and make the tier's own subdirectory in it; that one, resolved.

    The engine calls this before it loads the model, so a refused directory fails start-up in a moment, not
    after minutes of loading. Whoever can write these directories decides what the model answers: each
    must be a real directory of this user's that others cannot write; a lock file there must be trusted.
    Every refusal names the path and what to change.
    """
    root = Path(root).expanduser()
    _make_directory(root, parents=True)
    if not root.is_dir():
        raise NotADirectoryError(
            f"kv_cache_dir {root} is not a directory: point --kv-cache-dir (kv_cache_dir) at a directory, or "
            "at a path that does not exist yet (it is then created)"
        )
    root = root.resolve()
    _check_owner(root)
    own = root / BLOCKS_DIR
    _make_directory(own, parents=False)
    info = os.stat(own, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedFile(
            f"kv_cache_dir: {own} is {file_kind(info.st_mode)}, not a directory: the disk tier keeps its files in a "
            "directory of its own there. Remove it, or choose another kv_cache_dir"
        )
    _check_owner(own)
    if not os.access(own, os.R_OK | os.W_OK | os.X_OK):
        raise PermissionError(f"kv_cache_dir {own} is not writable by this user: `chmod u+rwx {own}`")
    with contextlib.suppress(FileNotFoundError):
        check_lock(os.stat(own / LOCK_FILE, follow_symlinks=False), own / LOCK_FILE)
    return own


def _make_directory(path: Path, parents: bool) -> None:
    """``mkdir`` (mode 0o700) unless something is there already; PermissionError saying what to change."""
    try:
        path.mkdir(mode=0o700, parents=parents, exist_ok=True)
    except FileExistsError:
        return  # a file or a dangling symlink: the checks that follow name it
    except PermissionError as exc:
        raise PermissionError(
            f"kv_cache_dir: cannot create {path} ({exc.strerror}): make its parent writable by this user, or "
            "choose another kv_cache_dir"
        ) from exc


def _check_owner(directory: Path) -> None:
    """Refuse a directory of another user's, or one other users can write."""
    info = directory.stat()
    if info.st_uid != os.geteuid():
        raise UntrustedFile(
            f"kv_cache_dir {directory} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}): "
            "whoever owns it decides what the model answers. Use a directory of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedFile(
            f"kv_cache_dir {directory} is writable by other users: whoever can write it decides what the model "
            f"answers. Use a directory of your own, or `chmod go-w {directory}`"
        )


def check_lock(info: os.stat_result, path: Path) -> None:
    """Refuse a lock file the tier cannot trust to keep the size total: it holds the bookkeeping of every
    process on the directory, and the tier truncates and rewrites it."""
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = file_kind(info.st_mode)
    elif info.st_uid != os.geteuid():
        problem = f"owned by uid {info.st_uid}, not this user"
    elif info.st_nlink != 1:
        problem = f"a file with {info.st_nlink} names (hard links)"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = "writable by other users"
    if problem is not None:
        raise UntrustedFile(
            f"kv_cache_dir: the disk tier's lock file {path} is {problem}: it cannot be trusted to keep the size "
            "limit, so the tier refuses it. Delete it (the tier makes a new one)"
        )
