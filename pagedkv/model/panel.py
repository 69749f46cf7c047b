"""Panel-packed linear weights and the C++ GEMM that reads them (``csrc/panel_linear.cpp``).

A CPU GEMM's inner loop broadcasts one activation against the weights of 16 outputs at once, so it wants
those 16 weights side by side for every k. :func:`pack` lays a weight ``[n, k]`` out that way once, at load
time, in one of three formats:

- ``"fp32"``: the weights themselves, reordered (a second copy of them, 4 bytes a weight).
- ``"q4"``: the GGUF file's Q4_1 codes (``w = d * q + m`` per 32 weights) -- 0.75 bytes a weight instead of 4.
- ``"q8"``: Q8_0 codes (``w = d * q``), which is how the default model stores its tied embedding / LM
  head -- 1.125 bytes a weight.

The codes are recovered from the fp32 weights by :mod:`pagedkv.model.codes` and reproduce the checkpoint's
weights bit for bit, not an approximation of them; a layer whose weights are not so coded stays fp32. Every
output is summed in one fixed order, so the result of a row does not depend on the batch it runs in.

The kernel is built on first use, in its own library (see :mod:`pagedkv.kernels`): it needs AVX2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedkv import kernels
from pagedkv.model import codes

PANEL = 16
FORMATS = {"fp32": 0, "q4": 1, "q8": 2}


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


def pack(weight: Tensor, format: str) -> PanelWeight | None:
    """Pack an fp32 weight ``[n, k]``; None if ``format`` is a code that does not reproduce it exactly."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {format!r}")
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"need an fp32 weight [n, k], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if format == "fp32":
        panels = _pad_rows(weight.detach(), n).view(-1, PANEL, k).transpose(1, 2)
        return PanelWeight(panels.contiguous().view(torch.uint8), n, k, format)
    coded = codes.encode_q4(weight) if format == "q4" else codes.encode_q8(weight)
    if coded is None:
        return None
    q, *scales = coded
    groups = k // codes.GROUP
    by_k = _by_group(q.view(n, groups, codes.GROUP), n, groups)  # [panels, groups, 32 k, 16 outputs]
    if format == "q4":  # two k per byte: even k in the low nibble, odd k in the high one
        by_k = by_k[:, :, 0::2] | (by_k[:, :, 1::2] << 4)
    parts = [by_k.contiguous().view(torch.uint8).flatten(2)]
    parts += [_by_group(s.unsqueeze(-1), n, groups).contiguous().view(torch.uint8).flatten(2) for s in scales]
    return PanelWeight(torch.cat(parts, dim=-1).contiguous(), n, k, format)


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
    only copy (measured: 4.6 us for one id, 12 us for 32, 1.5 ms for a 2,048-token chunk)."""
    return kernels.panel_rows(weight.packed, ids.to(torch.int64), weight.n, weight.k, FORMATS[weight.format])


def panel_linear(x: Tensor, weight: PanelWeight) -> Tensor:
    """``x @ W.T`` for fp32 ``x [..., k]``; raises if the kernel cannot be built."""
    if x.shape[-1] != weight.k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {weight.k}")
    if x.dim() == 2:  # what every layer passes: no reshape and view around the call (~2 us each, 121 calls a step)
        return kernels.panel_linear(x, weight.packed, weight.n, weight.k, FORMATS[weight.format])
    y = kernels.panel_linear(x.reshape(-1, weight.k), weight.packed, weight.n, weight.k, FORMATS[weight.format])
    return y.view(*x.shape[:-1], weight.n)
