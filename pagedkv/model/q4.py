"""Lossless 4-bit re-encoding of Q4_1 weights and the C++ GEMM that reads them.

The default checkpoint stores its linear weights as GGUF Q4_1 (per 32 input values of a row: fp16 ``d``,
``m`` and 4-bit ``q`` with ``w = d * q + m``); transformers expands them to fp32, so a decode step reads
4 bytes a weight where the file needed 0.625. :func:`encode` recovers the groups from the fp32 weights
(``m`` = group min, ``d`` = (max - min) / 15) and keeps them only if they reproduce every weight, so the
compressed layer computes with the file's weights, not an approximation of them. :func:`q4_linear` reads
the 4-bit codes plus fp32 ``d``/``m`` (0.75 bytes a weight), which is what bounds decode-size GEMMs on CPU.

The kernel (``attention/csrc/q4_linear.cpp``, shipped with the package data there) is built on first use
like the decode attention kernel: cached under ``<cache_root>/torch_extensions/q4-<hash>``, keyed by source,
flags, torch, Python and CPU flags. :func:`kernel_available` says whether it could be built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pagedkv import extension

logger = logging.getLogger(__name__)

GROUP = 32
LEVELS = 15
_SOURCE = Path(__file__).parent.parent / "attention" / "csrc" / "q4_linear.cpp"
_NAME = "pagedkv_q4_linear"
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


@dataclass(slots=True)
class Q4Weight:
    """A weight ``[n, k]`` as 4-bit codes ``qweight [n, k // 2]`` (uint8) and fp32 ``d``, ``m`` ``[n, k // 32]``.

    Byte ``j`` of a group's 16 bytes holds ``q[j]`` (low nibble) and ``q[j + 16]`` (high nibble).
    """

    qweight: Tensor
    d: Tensor
    m: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def dequantize(self) -> Tensor:
        """The fp32 weight ``[n, k]`` these codes stand for (for tests and fallbacks)."""
        n, k = self.shape
        q = _unpack(self.qweight)
        w = q.view(n, k // GROUP, GROUP).float() * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)
        return w.view(n, k)


def _unpack(qweight: Tensor) -> Tensor:
    n, half = qweight.shape
    groups = qweight.view(n, half // (GROUP // 2), GROUP // 2)
    return torch.cat([groups & 0x0F, groups >> 4], dim=-1).view(n, half * 2)


def encode(weight: Tensor, rtol: float = 1e-6, atol: float = 1e-7) -> Q4Weight | None:
    """Re-encode an fp32 weight ``[n, k]`` that came from Q4_1 groups; None if it did not.

    None when ``k`` is not a multiple of 32 or when some rebuilt weight is off by more than
    ``rtol * max|w| + atol`` (the layer then has to stay in fp32). The tolerance only absorbs the fp32
    rounding of ``(max - min) / 15``; any real quantisation is off by orders of magnitude more. The first
    rows are tried alone first, so a weight that is not Q4 (an fp32 or Q8_0 head) is rejected cheaply.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP != 0 or not weight.is_floating_point():
        return None
    w = weight.detach().float()
    if w.shape[0] > _PROBE_ROWS and _groups(w[:_PROBE_ROWS], rtol, atol) is None:
        return None
    return _groups(w, rtol, atol)


_PROBE_ROWS = 64


def _groups(w: Tensor, rtol: float, atol: float) -> Q4Weight | None:
    n, k = w.shape
    w = w.reshape(n, k // GROUP, GROUP)
    low, high = torch.aminmax(w, dim=-1)
    tolerance = rtol * max(high.max().item(), -low.min().item()) + atol if w.numel() else 0.0
    d = (high - low) / LEVELS
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d)).unsqueeze(-1)
    q = (w - low.unsqueeze(-1)).mul_(inverse).round_().clamp_(0, LEVELS)
    error = q.mul(d.unsqueeze(-1)).add_(low.unsqueeze(-1)).sub_(w).abs_().max().item() if w.numel() else 0.0
    if error > tolerance:
        return None
    codes = q.to(torch.uint8)
    packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
    return Q4Weight(packed.reshape(n, k // 2).contiguous(), d.contiguous(), low.contiguous())


_state = extension.BuildOnce("Q4 linear kernel", "linear layers keep their fp32 weights")


def build_directory() -> Path:
    """Where this source, built with these flags for this torch, Python and CPU, lives."""
    return extension.build_directory(_SOURCE, _CFLAGS + _LDFLAGS, prefix="q4-")


def _build() -> Callable[..., Tensor]:
    """Load or compile the library; return ``torch.ops.pagedkv_q4.q4_linear``."""
    extension.load_or_build(_NAME, _SOURCE, _CFLAGS, _LDFLAGS, build_directory())
    return torch.ops.pagedkv_q4.q4_linear


def kernel_available() -> bool:
    """Build (first call in this process) or load the kernel; False, with one warning, if that fails."""
    return _state.available(lambda: _build())  # looked up at call time, so a replaced _build is used


def q4_linear(x: Tensor, weight: Q4Weight) -> Tensor:
    """``x @ W.T`` for fp32 ``x [..., k]`` and a :class:`Q4Weight`; raises if the kernel cannot be built."""
    if not kernel_available():
        raise RuntimeError(f"the Q4 linear kernel is not available ({_state.error}); keep the fp32 weight")
    assert _state.op is not None
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the Q4 weight expects {k}")
    y = _state.op(x.reshape(-1, k), weight.qweight, weight.d, weight.m)
    return y.view(*x.shape[:-1], n)
