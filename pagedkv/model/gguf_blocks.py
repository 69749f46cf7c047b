"""A GGUF tensor's ggml blocks, used as the file stores them (``csrc/gguf_blocks.cpp``).

llama.cpp's quantised types are already the codes the panel GEMM computes on (``w = d * q + m`` per group),
so a GGUF weight need not be de-quantised to fp32 and packed again: :func:`pack` rearranges the file's codes
and scales into panels (:mod:`pagedkv.model.panel`), 0.59-1.25 bytes a weight instead of 4. A type packs into
a "wide" format (d and m multiplied out per group of 32 or 16 weights) and Q4_K, Q5_K, Q6_K and Q5_0 also into
a compact one that keeps the file's two-level scales as the file does (within 6 % of its size). :func:`rows`
de-quantises chosen rows straight from the blocks -- the embedding lookup on a memory-mapped file touches only
the rows it reads -- and :func:`dequantize` all of them, the fp32 reference.

Every weight comes out bit for bit as the ``gguf`` package's numpy ``dequantize`` makes it (what HF
transformers loads), whether read here or by the GEMM from the packed panels (the argument is in the C++
header). ``raw`` is a contiguous uint8 tensor ``[n, row_bytes]`` of the tensor's blocks; it may view a
read-only memory map: nothing writes to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

from pagedkv import kernels
from pagedkv.model.panel import FORMATS, PanelWeight


@dataclass(frozen=True, slots=True)
class BlockType:
    """A ggml type: ``block_size`` weights in ``type_size`` bytes, packed into ``panel_format`` (one of the
    ``formats`` it can be packed into)."""

    name: str
    block_size: int
    type_size: int
    formats: tuple[str, ...]

    @property
    def panel_format(self) -> str:
        return self.formats[0]


# The panel formats of each type whose codes the GEMM reads as they are (the table in csrc/panel_linear.cpp's
# header), the one a model is loaded in first: the compact one where there is one (the file's own blocks, within
# 6 % of its bytes, as fast a step as the wide format: benchmarks/panel_linear.py); the i-quants, ternary and fp4
# types have none: their weights are not d * q + m per group.
_PANEL_FORMATS = {
    GGMLQuantizationType.F32: ("fp32",),
    GGMLQuantizationType.F16: ("f16",),
    GGMLQuantizationType.BF16: ("bf16",),
    GGMLQuantizationType.Q4_0: ("q4",),
    GGMLQuantizationType.Q4_1: ("q4",),
    GGMLQuantizationType.Q5_0: ("q5", "q8"),
    GGMLQuantizationType.Q5_1: ("q8m",),
    GGMLQuantizationType.Q8_0: ("q8",),
    GGMLQuantizationType.Q2_K: ("q2k", "q4g16"),
    GGMLQuantizationType.Q3_K: ("q3k", "q8g16"),
    GGMLQuantizationType.Q4_K: ("q4k", "q4"),
    GGMLQuantizationType.Q5_K: ("q5k", "q8m"),
    GGMLQuantizationType.Q6_K: ("q6k", "q8g16"),
}
TYPES: dict[int, BlockType] = {
    int(t): BlockType(t.name, *GGML_QUANT_SIZES[t], formats) for t, formats in _PANEL_FORMATS.items()
}


def block_type(ggml_type: int) -> BlockType:
    """The supported type ``ggml_type``; a ValueError naming it if it is unknown or has no panel format."""
    if ggml_type in TYPES:
        return TYPES[ggml_type]
    try:
        name = GGMLQuantizationType(ggml_type).name
    except ValueError:
        raise ValueError(f"unknown ggml type id {ggml_type}") from None
    supported = ", ".join(t.name for t in TYPES.values())
    raise ValueError(f"ggml type {name} ({ggml_type}) has no panel format; supported: {supported}")


def pack(raw: Tensor, ggml_type: int, n: int, k: int, format: str | None = None) -> PanelWeight:
    """The weight ``[n, k]`` whose blocks are ``raw``, packed for the panel GEMM in ``format`` (one of the type's
    ``formats``; by default its ``panel_format``)."""
    t = block_type(ggml_type)
    fmt = format or t.panel_format
    if fmt not in t.formats:
        raise ValueError(f"{t.name} packs into {' or '.join(t.formats)}, not {fmt!r}")
    kernels.portable.require("GGUF blocks are read by them")
    return PanelWeight(torch.ops.pagedkv.gguf_pack(raw, int(ggml_type), n, k, FORMATS[fmt]), n, k, fmt)


def rows(raw: Tensor, ggml_type: int, ids: Tensor | Sequence[int], k: int) -> Tensor:
    """Rows ``ids`` of the weight as fp32 ``[len(ids), k]``, reading only those rows' blocks."""
    block_type(ggml_type)
    kernels.portable.require("GGUF blocks are read by them")
    ids = torch.as_tensor(ids, dtype=torch.int64).contiguous()
    return torch.ops.pagedkv.gguf_rows(raw, int(ggml_type), ids, k)


def dequantize(raw: Tensor, ggml_type: int, n: int, k: int) -> Tensor:
    """The whole weight ``[n, k]`` as fp32: the reference the packed weight computes with."""
    t = block_type(ggml_type)
    if k % t.block_size == 0 and raw.nbytes != n * (k // t.block_size) * t.type_size:
        raise ValueError(f"raw has {raw.nbytes} bytes, not the {n} rows of k = {k} {t.name} weights expected")
    return rows(raw, ggml_type, torch.arange(n), k)
