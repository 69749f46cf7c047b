"""The model's compiled CPU ops -- panel GEMM, RMSNorm, SiLU-and-multiply, RoPE -- built together on first use.

Sources: ``csrc/panel_linear.cpp`` (see :mod:`pagedkv.model.panel`), ``csrc/rms_norm.cpp`` and
``csrc/pointwise.cpp``. They are
compiled into one library, cached like the decode attention kernel (see :mod:`pagedkv.extension`), so a
machine pays one build for both. Where the build fails, :func:`available` is False (with one warning)
and the model runs on torch's GEMM and ``F.rms_norm``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from pagedkv import extension

_SOURCES = tuple(
    Path(__file__).parent / "csrc" / name for name in ("panel_linear.cpp", "rms_norm.cpp", "pointwise.cpp")
)
_NAME = "pagedkv_model_kernels"
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)

_state = extension.BuildOnce("model kernels (panel GEMM, RMSNorm, ...)", "the model runs on torch's ops")


def build_directory() -> Path:
    """Where these sources, built with these flags for this torch, Python and CPU, live."""
    return extension.build_directory(_SOURCES, _CFLAGS + _LDFLAGS, prefix="model-")


def _build() -> Callable[..., Tensor]:
    extension.load_or_build(_NAME, _SOURCES, _CFLAGS, _LDFLAGS, build_directory())
    return torch.ops.pagedkv_panel.panel_linear


def available() -> bool:
    """Build (first call in this process) or load the library; False, with one warning, if that fails."""
    return _state.available(lambda: _build())  # looked up at call time, so a replaced _build is used


def _require() -> None:
    if _state.op is None and not available():  # the lock-free check first: this runs a few hundred times a step
        raise RuntimeError(f"the compiled model kernels are not available ({_state.error}): use linear_backend='torch'")


def panel_linear(x: Tensor, packed: Tensor, n: int, k: int, format_code: int) -> Tensor:
    """The raw panel GEMM on a 2-D fp32 ``x`` (see :func:`pagedkv.model.panel.panel_linear`)."""
    _require()
    return torch.ops.pagedkv_panel.panel_linear(x, packed, n, k, format_code)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """``rms_norm(x) * weight``; with ``residual``: ``residual += x`` in place, then ``rms_norm(residual) * weight``.

    Contiguous 2-D fp32 ``x`` (and ``residual``) only.
    """
    _require()
    return torch.ops.pagedkv_norm.rms_norm(x, weight, eps, residual)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for a contiguous fp32 ``gate_up [T, 2I]`` (gate first); returns ``[T, I]``."""
    _require()
    return torch.ops.pagedkv_pointwise.silu_mul(gate_up)


def rope_(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """``x * cos + roll(x, D/2) * sin_signed`` in place on fp32 ``x [T, H, D]`` (any row strides, unit stride
    in D); ``cos`` and ``sin_signed`` hold ``T * D`` contiguous values (e.g. ``[T, 1, D]``). Returns ``x``."""
    _require()
    return torch.ops.pagedkv_pointwise.rope_(x, cos, sin_signed)
