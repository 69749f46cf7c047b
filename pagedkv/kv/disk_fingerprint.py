"""The disk tier's fingerprint: everything that decides the bits of a block's K/V besides its tokens.

A block key names tokens; the same tokens give other K/V under another model, weight format, kernel set,
block size, torch or pagedkv version, or on another instruction set (the compiled ops are built with
``-march=native``, and README: Determinism guarantees bits only within one of these). The fingerprint
enters the name of every file of the disk tier, so an engine that differs in any of them finds nothing
there, and is written into each file, where a load checks it again.

The model is fingerprinted by content (sha256 of its weight files, ~2 GB/s here: 46 ms for the default
model's 98 MB GGUF), not by path: a different checkpoint saved to the same path is a different model. The
digest is remembered in ``<kv_cache_dir>/models/``, keyed by the file's path, size, mtime and inode, so a
large model is read once, not at every start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch

import pagedkv
from pagedkv.extension import cpu_flags
from pagedkv.kv.disk_files import FORMAT, read_regular_file

_CHUNK = 1 << 24
_DIGEST = re.compile("[0-9a-f]{64}")


def model_files(source: Path) -> list[Path]:
    """The files whose content defines the model's numbers: a .gguf file, or an HF directory's config.json
    and weight files (tokenizer files do not change the K/V of given token ids)."""
    if source.is_file():
        return [source]
    return [source / "config.json", *sorted(source.glob("*.safetensors"))]


def file_digest(path: Path, memo_dir: Path) -> str:
    """sha256 of ``path``'s content, remembered in ``memo_dir`` under its path, size, mtime and inode."""
    info = path.stat()
    identity = f"{path.resolve()}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ino}".encode()
    memo = memo_dir / hashlib.sha256(identity).hexdigest()
    if remembered := _remembered(memo):
        return remembered
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    hexdigest = digest.hexdigest()
    with contextlib.suppress(OSError):  # only a lost memo: the next start reads the file again
        memo_dir.mkdir(mode=0o700, exist_ok=True)
        if stat.S_ISDIR(os.stat(memo_dir, follow_symlinks=False).st_mode):  # not through a planted symlink
            fd, tmp = tempfile.mkstemp(dir=memo_dir, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                f.write(hexdigest)
            os.replace(tmp, memo)
    return hexdigest


def _remembered(memo: Path) -> str | None:
    """The digest in ``memo``, if it is a regular file holding one (a FIFO there must not hang start-up)."""
    try:
        text = bytes(read_regular_file(memo, 128)).decode().strip()
    except (OSError, ValueError):
        return None
    return text if _DIGEST.fullmatch(text) else None


def engine_fingerprint(
    model_source: str | Path,
    memo_dir: Path,
    *,
    weight_format: str,
    kernels: bool,
    gemm: bool,
    attention: str,
    block_size: int,
    kv_dtype: torch.dtype,
) -> tuple[str, dict[str, Any]]:
    """The fingerprint (64 hex digits) and what it covers, for the log."""
    source = Path(model_source)
    parts: dict[str, Any] = {
        "format": FORMAT,
        "model": {p.name: file_digest(p, memo_dir) for p in model_files(source)},
        "weight_format": weight_format,
        "kernels": kernels,
        "gemm": gemm,
        "attention": attention,
        "block_size": block_size,
        "kv_dtype": str(kv_dtype),
        "torch": torch.__version__,
        "pagedkv": pagedkv.__version__,
        "cpu": hashlib.sha256(cpu_flags().encode()).hexdigest()[:16],
    }
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest(), parts
