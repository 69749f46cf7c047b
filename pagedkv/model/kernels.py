"""The model's compiled CPU ops -- the panel GEMM and RMSNorm -- built together on first use, once per machine.

Sources: ``csrc/panel_linear.cpp`` (see :mod:`pagedkv.model.panel`) and ``csrc/rms_norm.cpp``. They are
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

_SOURCES = (Path(__file__).parent / "csrc" / "panel_linear.cpp", Path(__file__).parent / "csrc" / "rms_norm.cpp")
_NAME = "pagedkv_model_kernels"
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)

_state = extension.BuildOnce("model kernels (panel GEMM, RMSNorm)", "the model uses torch's GEMM and RMSNorm")


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
    if not available():
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
