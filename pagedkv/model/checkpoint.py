"""The tensors of safetensors files by name, each read from disk into its own memory when asked for.

Why not ``safetensors.safe_open``: it maps the whole file, and every page a ``get_tensor`` touches stays in
the process's resident set until the handle closes. Loading the default model that way held its whole
540 MB fp32 checkpoint in RSS at once, next to the packed weights being built from it -- the load, not the
running engine, set the peak. Here each tensor is one positioned read (``os.preadv``) into a fresh tensor:
the file's pages stay in the kernel's page cache, which is not the process's memory, and a tensor the
loader has packed and dropped is gone. The format is small and fixed (an 8-byte little-endian header
length, a JSON header of ``name -> {dtype, shape, data_offsets}``, then the data), so reading it takes a
page of code; ``safetensors`` itself is still what writes the converted checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {  # the format's dtype names -> torch's, for the dtypes pagedkv reads
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit


class Checkpoint(Mapping):
    """``name -> tensor`` over one or more safetensors files; a tensor is read only when indexed."""

    def __init__(self, files: list[Path]) -> None:
        self._entries: dict[str, tuple[Path, int, int, torch.dtype, list[int]]] = {}
        for file in files:
            for name, (start, end, dtype, shape) in _read_header(file).items():
                self._entries[name] = (file, start, end, dtype, shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, start, end, dtype, shape = self._entries[name]
        data = torch.empty(end - start, dtype=torch.uint8)
        if end > start:
            with open(file, "rb", buffering=0) as f:
                done = 0
                view = memoryview(data.numpy())
                while done < end - start:  # a positioned read may return less than asked
                    got = os.preadv(f.fileno(), [view[done:]], start + done)
                    if got == 0:
                        raise ValueError(f"{str(file)!r} ends inside tensor {name!r}: the file is truncated")
                    done += got
        return data.view(dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _read_header(file: Path) -> dict[str, tuple[int, int, torch.dtype, list[int]]]:
    """``name -> (first byte, end byte, dtype, shape)`` of every tensor in ``file``, offsets from its start.

    Every entry is checked against the file's size here, before anything is allocated for it: a header
    claiming a terabyte, negative offsets or a negative dimension is refused, naming the file and tensor."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if not 0 < length <= min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{str(file)!r} is not a safetensors file (no header of a valid length)")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:  # not JSON, or not UTF-8
            raise ValueError(f"{str(file)!r} is not a safetensors file (its header is not JSON)") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{str(file)!r} is not a safetensors file (its header is not a JSON object)")
    base = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"{str(file)!r}: tensor {name!r} lacks a dtype, shape or pair of data_offsets") from exc
        if dtype_name not in SAFETENSORS_DTYPES:
            raise ValueError(f"{str(file)!r}: tensor {name!r} has dtype {dtype_name}, which pagedkv does not read")
        dtype = SAFETENSORS_DTYPES[dtype_name]
        if not all(type(n) is int and n >= 0 for n in [*shape, begin, end]) or begin > end:
            raise ValueError(f"{str(file)!r}: tensor {name!r} has a bad shape {shape} or data_offsets {[begin, end]}")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{str(file)!r}: tensor {name!r} has {end - begin} bytes for shape {shape}")
        if base + end > size:
            raise ValueError(f"{str(file)!r} ends inside tensor {name!r}: the file is truncated")
        entries[name] = (base + begin, base + end, dtype, shape)
    return entries
