"""The disk tier's block files: their format, their checks, and reading one without harm.

A block file is plain safetensors (never pickle): one tensor ``kv``, of the pool's dtype (float32 or
float16) and shape [2 (K, V), layers, block_size, kv_heads, head_dim], and in its metadata the format, the
engine's fingerprint, the block key, its parent's key and the sha256 of the tensor's bytes.
:func:`decode_block` checks all of them and the sizes before a byte is used: a truncated, corrupted or
misplaced file raises :class:`CorruptBlockFile`. Only a regular file is ever opened, without blocking
(:func:`read_regular_file`: a FIFO planted under a block's name would otherwise hang the reader forever).

Where the files live, how they are named, put in place, counted and deleted: ``pagedkv.kv.block_directory``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor

from pagedkv.kv.hashing import BlockKey

FORMAT = "pagedkv-kv-block-v1"  # the file format; bump it to orphan every file written before
MAX_HEADER = 64 << 10
MAX_HEADER_DEPTH = 3  # a block file's header: {"__metadata__": {...}, "kv": {"shape": [...], ...}}
# the pool's dtypes (ops.KV_DTYPES) as a block file names them
_SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16"}
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


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


def read_regular_file(path: str | Path, limit: int, dir_fd: int | None = None) -> bytearray:
    """The bytes of ``path`` (relative to ``dir_fd`` if given), a regular file of at most ``limit`` bytes.

    Anything else raises :class:`CorruptBlockFile` without being read or waited on: opening a FIFO blocks
    until a writer comes, a device may never end, a symlink leads out of the directory. So: lstat, an
    ``O_NOFOLLOW | O_NONBLOCK`` open, and fstat of what was opened (the name may have changed in between).
    FileNotFoundError if it is gone.
    """
    _require_regular(os.stat(path, dir_fd=dir_fd, follow_symlinks=False))
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        _require_regular(info)
        if info.st_size > limit:
            raise CorruptBlockFile(f"is {info.st_size} bytes, more than the {limit} such a file can have")
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
    if header_len > MAX_HEADER:
        raise CorruptBlockFile(f"declares a {header_len}-byte header, more than a block file's {MAX_HEADER}")
    if header_len > len(buffer) - 8:
        raise CorruptBlockFile("is truncated (in its header)")
    try:
        header = _parse_header(bytes(buffer[8 : 8 + header_len]))
        meta, entry = header["__metadata__"], header["kv"]
        begin, end = (int(x) for x in entry["data_offsets"])
        found, found_dtype, checksum = tuple(entry["shape"]), entry["dtype"], meta["sha256"]
        fields = (meta["format"], meta["fingerprint"], meta["key"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptBlockFile(f"has an unreadable header ({_short(exc)})") from exc
    if fields != (FORMAT, fingerprint, key.hex()):
        raise CorruptBlockFile("holds another block (format, fingerprint or key differ)")
    nbytes, name = dtype.itemsize * math.prod(shape), _SAFETENSORS_NAMES[dtype]
    if found_dtype != name or found != shape or (begin, end) != (0, nbytes):
        raise CorruptBlockFile(
            f"holds a {_short(found_dtype)} tensor of shape {_short(list(found))} at bytes "
            f"{_short([begin, end])}, not {name} {list(shape)} at [0, {nbytes}]"
        )
    offset = 8 + header_len
    if offset + nbytes != len(buffer):
        raise CorruptBlockFile(f"is {len(buffer)} bytes, not {offset + nbytes} (truncated?)")
    if hashlib.sha256(memoryview(buffer)[offset:]).hexdigest() != checksum:
        raise CorruptBlockFile("fails its checksum")
    return torch.frombuffer(buffer, dtype=dtype, offset=offset, count=math.prod(shape)).view(shape)


def _parse_header(raw: bytes) -> dict:
    """A block file's JSON header, its nesting checked first: ``json`` recurses once per level, and a header
    nested thousands deep raised RecursionError out of the loader (every running request was aborted)."""
    if _json_depth(raw) > MAX_HEADER_DEPTH:
        raise ValueError(f"nested deeper than a block file's {MAX_HEADER_DEPTH} levels")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError(f"a {type(header).__name__}, not an object")
    return header


def _json_depth(raw: bytes) -> int:
    """How deep JSON text nests its arrays and objects (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub(b"", raw)):
        depth += 1 if bracket in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _require_regular(info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise CorruptBlockFile(f"is {file_kind(info.st_mode)}, not a regular file")


def file_kind(mode: int) -> str:
    """What a file is, in words, for messages."""
    kinds = ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"))
    kinds += ((stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    return next((word for test, word in kinds if test(mode)), "a regular file" if stat.S_ISREG(mode) else "odd")


def _short(value: object, limit: int = 80) -> str:
    """``value`` in words, cut to ``limit`` characters: a hostile header's values must not flood the log."""
    text = f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
