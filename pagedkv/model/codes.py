"""Recovering a GGUF file's exact quantisation codes from the fp32 weights transformers expanded them to.

transformers de-quantises GGUF tensors to fp32 on load, so a Q4_1 layer arrives as 4 bytes a weight where
the file needed 0.625. Each 32-weight group of such a layer still holds only 16 (Q4_1) or 255 (Q8_0)
distinct values, and its scale(s) can be read back from the group itself. The functions here do that and
keep the codes only if they give back every weight bit for bit, so a layer running on them computes with
the checkpoint's weights, not an approximation of them. Anything else (an fp32 checkpoint, another code)
is rejected, and that layer keeps fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32
Q4_LEVELS = 15
Q8_LEVELS = 127
_PROBE_ROWS = 64  # a weight that is not coded is rejected on its first rows, without touching the rest


def encode_q4(weight: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(q uint8 [n, k] in 0..15, d [n, k // 32], m [n, k // 32])`` with ``d * q + m == weight``, or None.

    GGUF Q4_1 stores fp16 ``d`` and ``m`` per group and de-quantises with ``d * q + m`` in fp32 (multiply,
    then add). llama.cpp's quantiser maps a group's minimum to q = 0 and its maximum to q = 15, so ``m`` is
    the group minimum and ``d`` its range / 15, each rounded to fp16.
    """
    return _probed(weight, _q4)


def encode_q8(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(q int8 [n, k], d [n, k // 32])`` with ``q * d == weight`` exactly, or None.

    GGUF Q8_0 stores an fp16 ``d = max|w| / 127`` per group and ``q = round(w / d)``, so the largest weight
    of a group is ``127 * d`` and ``d`` is recovered as ``max|w| / 127`` rounded to fp16.
    """
    return _probed(weight, _q8)


def _probed(weight: Tensor, encode):
    if weight.dim() != 2 or weight.shape[1] % GROUP != 0 or not weight.is_floating_point():
        return None
    groups = weight.detach().float().unflatten(1, (-1, GROUP))  # [n, k // 32, 32]
    if groups.shape[0] > _PROBE_ROWS and encode(groups[:_PROBE_ROWS]) is None:
        return None
    return encode(groups)


def _q4(groups: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    low, high = torch.aminmax(groups, dim=-1)
    m = low.half().float()
    d = ((high - low) / Q4_LEVELS).half().float()
    q = (groups - m.unsqueeze(-1)).mul_(_inverse(d)).round_().clamp_(0, Q4_LEVELS)
    if not torch.equal(q * d.unsqueeze(-1) + m.unsqueeze(-1), groups):
        return None
    return q.to(torch.uint8).flatten(1), d, m


def _q8(groups: Tensor) -> tuple[Tensor, Tensor] | None:
    d = (groups.abs().amax(dim=-1) / Q8_LEVELS).half().float()
    q = (groups * _inverse(d)).round_().clamp_(-Q8_LEVELS, Q8_LEVELS)
    if not torch.equal(q * d.unsqueeze(-1), groups):
        return None
    return q.to(torch.int8).flatten(1), d


def _inverse(d: Tensor) -> Tensor:
    """``1 / d`` per group, broadcastable over the group's weights; 0 for all-zero (d = 0) groups."""
    return torch.where(d > 0, 1.0 / d, torch.zeros_like(d)).unsqueeze(-1)
