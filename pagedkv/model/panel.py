"""Panel-packed linear weights and the C++ GEMM that reads them (``csrc/panel_linear.cpp``).

A CPU GEMM's inner loop broadcasts one activation against the weights of 16 outputs at once, so it wants
those 16 weights side by side for every k. A weight ``[n, k]`` is laid out that way once, at load time, in
one of these formats (the C++ header has the byte layouts):

- ``"fp32"``: the weights themselves, reordered (4 bytes a weight).
- ``"f16"``, ``"bf16"``: half-precision bits, widened exactly to fp32 in the kernel (2 bytes a weight).
- quantised, ``w = d * q + m`` or ``w = d * q`` per group of G weights of an output, with fp32 ``d`` (and
  ``m``) and integer codes ``q`` (:data:`CODED`): ``"q4"`` (4-bit codes, G = 32, with a min: Q4_0, Q4_1, Q4_K;
  0.75 bytes a weight), ``"q8"`` (int8, G = 32: Q5_0, Q8_0; 1.125), ``"q8m"`` (int8 with a min: Q5_1, Q5_K;
  1.25), ``"q4g16"`` (4-bit with a min, G = 16: Q2_K; 1), ``"q8g16"`` (int8, G = 16: Q3_K, Q6_K; 1.25).
- compact, a GGUF block's codes and two-level scales as the file keeps them (``w = (d sc) q - dmin mn`` or
  ``(d sc) (q - offset)`` per sub-block, multiplied out by the kernel): ``"q4k"`` (Q4_K; 0.59 bytes a weight),
  ``"q6k"`` (Q6_K; 0.83), ``"q5"`` (Q5_0; 0.75), ``"q5k"`` (Q5_K; 0.72), ``"q2k"`` (Q2_K; 0.66),
  ``"q3k"`` (Q3_K; 0.58) (:data:`COMPACT`). Only
  :func:`pagedkv.model.gguf_blocks.pack` packs them.

:func:`pack_fp32` packs an fp32 weight; :func:`pack_codes` and :func:`pack_half` pack codes and half-precision
bits (a GGUF file's own blocks are packed by :mod:`pagedkv.model.gguf_blocks`). Every format computes with
exactly its weights in fp32, and every output is summed in one fixed order, so the result of a row does not
depend on the batch it runs in, nor on the format that holds the same weights.

The kernel is built on first use, in its own library (see :mod:`pagedkv.kernels`): it needs AVX2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from pagedkv import kernel_ops, kernels

PANEL = 16
COMPACT = {"q4k": 8, "q6k": 9, "q5": 10, "q5k": 11, "q2k": 12, "q3k": 13}
# A GGUF file's blocks for the int8-activation GEMM (``csrc/int8_linear.cpp``, weight_format "gguf-int8"),
# repacked at load in groups of 16 outputs (``csrc/int8_repack.h``): code INT8_REPACKED_BASE + the ggml type id.
INT8_REPACKED_BASE = 128
INT8_FORMATS = {
    "int8-q4_0-x16": 130, "int8-q4_1-x16": 131, "int8-q5_0-x16": 134, "int8-q8_0-x16": 136,
    "int8-q4_k-x16": 140, "int8-q6_k-x16": 142,
}  # fmt: skip
FORMATS = {"fp32": 0, "q4": 1, "q8": 2, "q8m": 3, "q4g16": 4, "q8g16": 5, "f16": 6, "bf16": 7} | COMPACT | INT8_FORMATS


class Coded(NamedTuple):
    """A quantised format: ``bits``-bit codes (4: unsigned 0..15; 8: int8), ``group`` k per d (and m)."""

    bits: int
    group: int
    has_min: bool


CODED = {
    "q4": Coded(4, 32, True),
    "q8": Coded(8, 32, False),
    "q8m": Coded(8, 32, True),
    "q4g16": Coded(4, 16, True),
    "q8g16": Coded(8, 16, False),
}
HALF = {"f16": torch.float16, "bf16": torch.bfloat16}


@dataclass(slots=True)
class PanelWeight:
    """A weight ``[n, k]`` packed for :func:`panel_linear`; ``packed`` is opaque (see the C++ header)."""

    packed: Tensor
    n: int
    k: int
    format: str

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


def pack_fp32(weight: Tensor) -> PanelWeight:
    """An fp32 weight ``[n, k]`` packed as ``"fp32"``: its values reordered into panels."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"need an fp32 weight [n, k], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    panels = _pad_rows(weight.detach(), n).view(-1, PANEL, k).transpose(1, 2)
    return PanelWeight(panels.contiguous().view(torch.uint8), n, k, "fp32")


def pack_codes(q: Tensor, d: Tensor, m: Tensor | None, format: str) -> PanelWeight:
    """The weight ``w[i, j] = d[i, j // G] * q[i, j] (+ m[i, j // G])`` packed in the quantised ``format``.

    ``q``: integer codes ``[n, k]`` (0..15 for 4-bit formats, -128..127 for 8-bit ones); ``d`` and ``m``: fp32
    ``[n, k // G]``, ``m`` given exactly when the format has a min. With a min, ``d * q`` must be exact in fp32
    (see the C++ header), as it is for every GGUF type packed so.
    """
    if format not in CODED:
        raise ValueError(f"format must be one of {tuple(CODED)}, got {format!r}")
    bits, group, has_min = CODED[format]
    if q.dim() != 2 or q.dtype.is_floating_point or q.dtype.is_complex or q.shape[1] % group:
        raise ValueError(
            f"{format} needs integer codes [n, k] with k a multiple of {group}, got {q.dtype} {tuple(q.shape)}"
        )
    n, k = q.shape
    groups = k // group
    scales = [d] + ([m] if has_min else [])
    if (m is not None) != has_min or any(s.dtype != torch.float32 or s.shape != (n, groups) for s in scales):
        raise ValueError(
            f"{format} needs fp32 d{' and m' if has_min else ' and no m'} of shape {(n, groups)}, got "
            + ", ".join(f"{s.dtype} {tuple(s.shape)}" for s in (d, m) if s is not None)
        )
    low, high = (0, 15) if bits == 4 else (-128, 127)
    if q.numel() and not (low <= q.min().item() and q.max().item() <= high):
        raise ValueError(f"{format} codes must lie in [{low}, {high}]")
    q = q.to(torch.uint8 if bits == 4 else torch.int8)
    by_k = _by_group(q.view(n, groups, group), n, groups)  # [panels, groups, G k, 16 outputs]
    if bits == 4:  # two k per byte: even k in the low nibble, odd k in the high one
        by_k = by_k[:, :, 0::2] | (by_k[:, :, 1::2] << 4)
    parts = [by_k.contiguous().view(torch.uint8).flatten(2)]
    parts += [_by_group(s.unsqueeze(-1), n, groups).contiguous().view(torch.uint8).flatten(2) for s in scales]
    return PanelWeight(torch.cat(parts, dim=-1).contiguous(), n, k, format)


def pack_half(bits: Tensor, format: str) -> PanelWeight:
    """A weight ``[n, k]`` of half-precision values packed as ``"f16"`` or ``"bf16"``: ``bits`` are the values
    (float16 / bfloat16, matching ``format``) or their bit patterns (int16 / uint16)."""
    if format not in HALF:
        raise ValueError(f"format must be one of {tuple(HALF)}, got {format!r}")
    if bits.dim() != 2 or bits.dtype not in (torch.int16, torch.uint16, HALF[format]):
        raise ValueError(
            f"{format} needs [n, k] int16, uint16 or {HALF[format]} bits, got {bits.dtype} {tuple(bits.shape)}"
        )
    n, k = bits.shape
    panels = _pad_rows(bits.detach().contiguous().view(torch.int16), n).view(-1, PANEL, k).transpose(1, 2)
    return PanelWeight(panels.contiguous().view(torch.uint8), n, k, format)


def _pad_rows(t: Tensor, n: int) -> Tensor:
    """``t`` with zero rows appended up to a whole number of panels."""
    extra = -n % PANEL
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _by_group(t: Tensor, n: int, groups: int) -> Tensor:
    """``[n, groups, g]`` -> ``[panels, groups, g, 16]``: per panel and group, each k's 16 outputs together."""
    return _pad_rows(t, n).view(-1, PANEL, groups, t.shape[-1]).permute(0, 2, 3, 1)


def rows(weight: PanelWeight, ids: Tensor) -> Tensor:
    """Rows ``ids`` of the weight ``[n, k]`` as fp32 ``[len(ids), k]``, decoded from the packed form in C++: bit
    for bit the weights that were packed. What the embedding lookup reads when a tied LM head's panel holds the
    only copy (measured: 4.6 us for one id, 12 us for 32, 1.5 ms for a 2,048-token chunk). An int8-activation
    weight is the file's blocks repacked in groups of 16 outputs: the rows asked for are unpacked back to the
    file's blocks and de-quantised from them, as an untied embedding's are."""
    if weight.format in INT8_FORMATS:
        kernels.portable.require("GGUF blocks are read by them")
        code, ids = INT8_FORMATS[weight.format], ids.to(torch.int64).contiguous()
        blocks = torch.ops.pagedkv.int8_repacked_blocks(weight.packed, ids, weight.n, weight.k, code)
        return torch.ops.pagedkv.gguf_rows(blocks, code - INT8_REPACKED_BASE, torch.arange(len(ids)), weight.k)
    return kernel_ops.panel_rows(weight.packed, ids.to(torch.int64), weight.n, weight.k, FORMATS[weight.format])


def panel_linear(x: Tensor, weight: PanelWeight) -> Tensor:
    """``x @ W.T`` for fp32 ``x [..., k]``; raises if the kernel cannot be built."""
    if x.shape[-1] != weight.k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {weight.k}")
    gemm = kernel_ops.int8_linear if weight.format in INT8_FORMATS else kernel_ops.panel_linear
    if x.dim() == 2:  # what every layer passes: no reshape and view around the call (~2 us each, 121 calls a step)
        return gemm(x, weight.packed, weight.n, weight.k, FORMATS[weight.format])
    y = gemm(x.reshape(-1, weight.k), weight.packed, weight.n, weight.k, FORMATS[weight.format])
    return y.view(*x.shape[:-1], weight.n)


def panel_linear_into(x: Tensor, weight: PanelWeight, y: Tensor, col: int) -> None:
    """``y[:, col : col + n] = x @ W.T`` for fp32 ``x [M, k]`` and a contiguous fp32 ``y [M, N]``; y's other
    columns are left as they are. A fused layer (q|k|v) whose parts are packed apart, in different formats
    even, runs one call per part into one output; each column gets the bits :func:`panel_linear` gives it."""
    if x.shape[-1] != weight.k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {weight.k}")
    gemm = kernel_ops.int8_linear_into if weight.format in INT8_FORMATS else kernel_ops.panel_linear_into
    gemm(x, weight.packed, weight.n, weight.k, FORMATS[weight.format], y, col)
