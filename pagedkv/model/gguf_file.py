"""A GGUF file (or a split set of them) read in place: its metadata, and its tensors as views of the mapped file.

Why a reader of our own rather than ``gguf.GGUFReader``: every tensor must be checked against the file before
anything is allocated for it, and a bad file must say which file and which tensor are wrong ("ends inside
tensor blk.3.ffn_down.weight"), where GGUFReader fails with a numpy reshape error. The format is small: a
header (magic, version, counts), typed key/value metadata, one record per tensor (name, dims, ggml type,
offset), then the aligned data. Nothing here copies tensor data: a tensor is a ``uint8`` view of the
``mmap`` of its file, so a weight costs memory only for the pages the kernels' packing reads, and those pages
are the kernel's page cache, shared with any other process mapping the same file.

Split files (``name-00001-of-00003.gguf``, llama.cpp's ``gguf-split``) are one model: the metadata is the
first file's, the tensors are all of theirs.
"""

from __future__ import annotations

import mmap
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_COUNT = 1 << 24  # tensors or metadata entries in one file: far above any real model's
_MAX_DIMS = 4
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# metadata value types of the format: id -> (struct code, size); 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file pagedkv cannot use; the message names the file (and the tensor) and what is wrong."""


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its ggml type, its shape in torch's order (rows first) and its bytes.

    ``data`` is ``uint8 [rows, row_bytes]``: each row of a weight ``[n, k]`` is ``k / block_size`` ggml blocks,
    so slicing rows (tensor-parallel shards, llama's q/k row order) needs no de-quantisation.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: Tensor
    file: Path

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def k(self) -> int:
        return self.shape[-1]

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        """Rows (``dim`` 0) or columns (``dim`` 1, whole blocks only) ``[start, start + length)``."""
        if dim == 0:
            return self._with(self.data[start : start + length], (length, *self.shape[1:]))
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        if len(self.shape) != 2 or start % block or length % block:
            raise GGUFError(
                f"{self.file}: tensor {self.name!r} ({self.type_name}) cannot be split at columns "
                f"[{start}, {start + length}): a {self.type_name} block holds {block} weights; choose a "
                "tensor_parallel_size that splits it into whole blocks"
            )
        columns = self.data[:, start // block * size : (start + length) // block * size]
        return self._with(columns, (self.shape[0], length))

    def pad_rows(self, rows: int) -> GGUFTensor:
        """Zero rows appended up to ``rows``: an all-zero ggml block de-quantises to zeros in every type."""
        extra = self.data.new_zeros(rows - self.shape[0], self.data.shape[1])
        return self._with(torch.cat([self.data, extra]), (rows, *self.shape[1:]))

    def take_rows(self, order: Tensor) -> GGUFTensor:
        """The rows in ``order`` (a permutation), copied: llama.cpp stores llama's q/k rows interleaved."""
        return self._with(self.data.index_select(0, order), self.shape)

    def _with(self, data: Tensor, shape: tuple[int, ...]) -> GGUFTensor:
        return GGUFTensor(self.name, self.ggml_type, shape, data, self.file)


class GGUFFile:
    """The metadata and tensors of a GGUF model, its files mapped read-only for as long as this object lives."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self._maps: list[mmap.mmap] = []
        self._spans: dict[str, tuple[int, int]] = {}  # the first file's bytes of each metadata record
        for index, file in enumerate(split_files(self.path)):
            metadata, spans = self._read(file)
            if index == 0:
                self.metadata, self._spans = metadata, spans

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def files(self) -> list[Path]:
        return split_files(self.path)

    def metadata_record(self, key: str) -> bytes:
        """The bytes of metadata entry ``key`` as the file holds them (key, type, value): for writing a copy of
        some of the metadata (:mod:`pagedkv.model.gguf_convert`) without knowing each value's type."""
        start, end = self._spans[key]
        return self._maps[0][start:end]

    def release_pages(self) -> None:
        """Drop the mapped pages from this process's resident set (they stay in the page cache): called once the
        weights are packed, so a load does not leave the file counted in RSS next to the packed copy."""
        for mapped in self._maps:
            mapped.madvise(mmap.MADV_DONTNEED)

    def _read(self, file: Path) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
        size = file.stat().st_size
        with open(file, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        if mapped is None or size < 24 or mapped[:4] != MAGIC:
            raise GGUFError(f"{file} is not a GGUF file (it does not start with the GGUF magic)")
        self._maps.append(mapped)
        cursor = _Cursor(mapped, file)
        version = cursor.scalar("I")
        if version not in (2, 3):
            raise GGUFError(f"{file}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_metadata = cursor.scalar("Q"), cursor.scalar("Q")
        if n_tensors > _MAX_COUNT or n_metadata > _MAX_COUNT:
            raise GGUFError(f"{file}: header claims {n_tensors} tensors and {n_metadata} metadata entries")
        metadata, spans = {}, {}
        for _ in range(n_metadata):
            start = cursor.offset
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("I"), key)
            spans[key] = (start, cursor.offset)
        records = [self._tensor_record(cursor, file) for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cursor.offset // alignment) * alignment
        with warnings.catch_warnings():  # the map is read-only and we never write to it
            warnings.simplefilter("ignore", UserWarning)
            everything = torch.frombuffer(mapped, dtype=torch.uint8)
        for name, ggml_type, shape, offset, nbytes in records:
            if name in self.tensors:
                raise GGUFError(f"{file}: tensor {name!r} appears twice")
            first = start + offset
            if first + nbytes > size:
                raise GGUFError(f"{file} ends inside tensor {name!r}: the file is truncated")
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            data = everything[first : first + nbytes].view(rows, nbytes // rows)
            self.tensors[name] = GGUFTensor(name, ggml_type, shape, data, file)
        return metadata, spans

    @staticmethod
    def _tensor_record(cursor: _Cursor, file: Path) -> tuple[str, int, tuple[int, ...], int, int]:
        name = cursor.string()
        n_dims = cursor.scalar("I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GGUFError(f"{file}: tensor {name!r} has {n_dims} dimensions")
        dims = [cursor.scalar("Q") for _ in range(n_dims)]
        raw_type, offset = cursor.scalar("I"), cursor.scalar("Q")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{file}: tensor {name!r} has an unknown ggml type id {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if any(d <= 0 for d in dims) or dims[0] % block:
            raise GGUFError(f"{file}: tensor {name!r} has shape {dims}, not whole {ggml_type.name} blocks")
        nbytes = int(np.prod(dims, dtype=object)) // block * type_size
        return name, int(ggml_type), tuple(reversed(dims)), offset, nbytes


class _Cursor:
    """Reads the header's little-endian fields in order, refusing to read past the end of the file."""

    def __init__(self, data: mmap.mmap, file: Path) -> None:
        self.data, self.file, self.offset = data, file, 4

    def take(self, size: int) -> memoryview | bytes:
        if size < 0 or self.offset + size > len(self.data):
            raise GGUFError(f"{self.file} ends inside its header: the file is truncated or not GGUF")
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def scalar(self, code: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if count > len(self.data):
                raise GGUFError(f"{self.file}: metadata {key!r} claims {count} items")
            if item in _SCALARS:  # numbers: one read, not one struct call per item
                code = _SCALARS[item]
                return np.frombuffer(self.take(count * struct.calcsize(code)), dtype="<" + code).tolist()
            return [self.value(item, key) for _ in range(count)]
        raise GGUFError(f"{self.file}: metadata {key!r} has an unknown value type {kind}")


def split_files(path: Path) -> list[Path]:
    """``path`` alone, or every file of its split set (any one of them may be given), in order."""
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    files = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise GGUFError(f"{path} is part {match['index']} of {count}, but {missing} are missing beside it")
    return files
