"""pagedkv's compiled CPU ops: two libraries, built on first use and cached per machine (:mod:`pagedkv.extension`).

- :data:`portable` (``csrc/paged_attention.cpp``, ``rms_norm.cpp``, ``pointwise.cpp``, sharing ``csrc/simd.h``):
  attention over the paged pool, RMSNorm with the residual add, SiLU-and-multiply, RoPE. Written
  against the compiler's vector types, so it builds wherever a C++ compiler does. Also ``decoder_stack.cpp``,
  which runs a model's layers through these ops (and the GEMM, found by name) in one call from Python.
- :data:`gemm` (``csrc/panel_linear.cpp``): the panel GEMM, written for AVX2 + FMA. A CPU without them
  loses only this library: the linear layers run on torch's GEMM and everything else stays compiled.

Every op registers in one namespace, ``torch.ops.pagedkv``. The Python faces below check what the C++ would
reject with a vaguer message and skip conversions that would be no-ops (each ``.to()`` costs microseconds,
and they run a few hundred times a step). Where a library cannot be built, the engine runs torch's ops,
which the tests hold to the same numbers.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from pagedkv.extension import UnsafeCacheDirectory, build_directory, load_or_build, summarize_error
from pagedkv.kv.ops import KV_DTYPES

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
ENV_VAR = "PAGEDKV_KERNELS"
CFLAGS = ("-O3", "-march=native", "-fopenmp")  # no -ffast-math: the kernels rely on -inf (empty softmax max)
LDFLAGS = ("-fopenmp",)


class CompiledLibrary:
    """One library of ``torch.ops.pagedkv`` ops, built from ``sources`` on first use, once per process.

    Where the build fails (no compiler, no ninja, an instruction set a source needs), :meth:`available` is
    False, with one warning saying what runs instead. An unsafe cache directory raises
    :class:`UnsafeCacheDirectory` instead, at every call: it is an error the user must fix, not a reason to
    run slower. Thread-safe: the engine thread and a server's startup may both ask.
    """

    def __init__(self, name: str, sources: Sequence[Path], headers: Sequence[Path], what: str, fallback: str) -> None:
        self.name = name
        self.sources, self.headers = tuple(sources), tuple(headers)
        self.what = what  # names the ops in messages
        self.fallback = fallback  # says what runs instead
        self.loaded = False
        self.error: str | None = None
        self._tried = False
        self._refused: str | None = None  # an unsafe cache's message, raised at every call
        self._lock = threading.Lock()

    def fresh(self) -> CompiledLibrary:
        """The same library in a process that has not tried to build it yet (tests simulate a new start)."""
        return CompiledLibrary(self.name, self.sources, self.headers, self.what, self.fallback)

    def build_directory(self) -> Path:
        """Where these sources and headers, built with these flags for this torch, Python and CPU, live."""
        return build_directory((*self.sources, *self.headers), CFLAGS + LDFLAGS, prefix=f"{self.name}-")

    def build(self) -> None:
        load_or_build(self.name, self.sources, CFLAGS, LDFLAGS, self.build_directory())

    def available(self) -> bool:
        """Load or build the library (first call in this process); False, with one warning, if that failed."""
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self.build()
                    self.loaded = True
                except UnsafeCacheDirectory as exc:
                    self._refused = self.error = str(exc)
                except Exception as exc:  # whatever else stops the build means: use the fallback
                    self.error = summarize_error(exc)
                    logger.debug("%s build failed", self.what, exc_info=True)
                    logger.warning("pagedkv: the %s could not be built (%s); %s", self.what, self.error, self.fallback)
            if self._refused is not None:
                raise UnsafeCacheDirectory(self._refused)
            return self.loaded

    def start_building(self) -> None:
        """Load or build the library on a thread of its own, so that a first start compiles it while the
        caller builds another one (each build's compiler runs single-threaded for long stretches, and a
        2-core machine otherwise idles one core for the whole GEMM build). :meth:`available` then waits for it.
        """
        if not self._tried and not self._lock.locked():
            threading.Thread(target=self._available_quietly, name=f"build-{self.name}", daemon=True).start()

    def _available_quietly(self) -> None:
        try:
            self.available()
        except UnsafeCacheDirectory:
            pass  # raised again at the caller's own available(), where it is the user's to fix

    def require(self, instead: str) -> None:
        """Raise RuntimeError naming ``instead`` unless the library is loaded (one attribute read once it is)."""
        if not self.loaded and not self.available():
            raise RuntimeError(f"the {self.what} are not available ({self.error}): {instead}")


def use_compiled(requested: bool | None, source: str, library: CompiledLibrary) -> bool:
    """Whether to run ``library``'s ops: never if ``requested`` is False, else if the library builds.

    Asked for (``requested`` True, from ``source``) where it cannot be built, this says so in a warning and
    returns False rather than failing: an engine must start anyway. An unsafe cache directory is the
    exception: :class:`UnsafeCacheDirectory` reaches the caller, so the user fixes it rather than running
    slower without knowing why.
    """
    if requested is False:
        return False
    if library.available():
        return True
    if requested:
        logger.warning("%s asked for the %s, which cannot be built here: %s", source, library.what, library.fallback)
    else:
        logger.info("the %s are unavailable: %s", library.what, library.fallback)
    return False


portable = CompiledLibrary(
    "pagedkv_ops",
    [_CSRC / name for name in ("paged_attention.cpp", "rms_norm.cpp", "pointwise.cpp", "decoder_stack.cpp",
                               "gguf_blocks.cpp")],
    [_CSRC / "simd.h"],
    what="compiled ops (paged attention, RMSNorm, SiLU, RoPE)",
    fallback="torch's ops run instead (attention_backend='gather', kernels=False skip the attempt)",
)
gemm = CompiledLibrary(
    "pagedkv_gemm",
    [_CSRC / "panel_linear.cpp"],
    [],
    what="panel GEMM ops (AVX2 + FMA)",
    fallback="the linear layers run on torch's GEMM",
)


def use_kernels(requested: bool | None) -> bool:
    """The ``kernels=`` option: ``requested``, else ``$PAGEDKV_KERNELS`` (1 or 0), else on where they build.

    On means the norms, SiLU and RoPE run compiled, and the linear layers too where :data:`gemm` builds.
    """
    source = "kernels=True"
    value = os.environ.get(ENV_VAR, "").strip()
    if requested is None and value:
        if value not in ("0", "1"):
            raise ValueError(f"${ENV_VAR}={value!r}: set it to 1 (compiled ops) or 0 (torch's ops), or unset it")
        requested, source = value == "1", f"${ENV_VAR}=1"
    if requested is not False:
        gemm.start_building()  # built beside the portable library, not after it
    on = use_compiled(requested, source, portable)
    if on and requested:
        use_compiled(requested, source, gemm)  # says so if the GEMM cannot be built
    return on


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
) -> Tensor:
    """Causal ``softmax(q K^T * scale) V`` for every new row of a step, K/V read in place from the pool.

    q ``[T, Hq, D]`` (rows may be strided, as the q heads of a fused qkv row are); pools ``[num_blocks,
    block_size, Hkv, D]``, contiguous, fp32 or fp16 (read as fp32: the same bits as an fp32 pool holding
    those values); q fp32. Request ``b``'s rows are
    ``q[qsl[b]:qsl[b + 1]]`` (``query_start_loc [B + 1]``, from 0 to ``T``); row ``i`` sits at position
    ``seq_lens[b] - (qsl[b + 1] - i)`` and attends keys ``[0, position]``, whose K/V must be in the pool
    already, its own included. ``block_tables [B, max_blocks]`` padded with 0. Query head ``h`` uses KV head
    ``h // (Hq // Hkv)``. A decode is a request with one row.

    Batch invariant: a row gets the same bits whatever else is in the call, however its request's rows are
    split into calls, and on any thread count.
    """
    portable.require("use attention_backend='gather'")
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(
            f"need q [T, Hq, D] and equal pools [num_blocks, block_size, Hkv, D], got q {tuple(q.shape)}, "
            f"k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}"
        )
    if q.dtype != torch.float32 or k_pool.dtype != v_pool.dtype or k_pool.dtype not in KV_DTYPES.values():
        raise ValueError(
            "q must be float32 and the pools both float32 or both float16, got dtypes "
            f"{q.dtype}, {k_pool.dtype}, {v_pool.dtype}"
        )
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("k_pool and v_pool must be contiguous: the kernel addresses them by flat slot")
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # the kernel takes any row stride, nothing else
        q = q.contiguous()
    return torch.ops.pagedkv.paged_attention(
        q,
        k_pool,
        v_pool,
        _dense(block_tables, torch.int64),
        _dense(seq_lens, torch.int64),
        _dense(query_start_loc, torch.int64),
        float(scale),
    )


def _dense(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """``rms_norm(x) * weight``; with ``residual``: ``residual += x`` in place, then ``rms_norm(residual) * weight``.

    Contiguous 2-D fp32 ``x`` (and ``residual``) only.
    """
    portable.require("use kernels=False")
    return torch.ops.pagedkv.rms_norm(x, weight, eps, residual)


def write_kv(k_pool: Tensor, v_pool: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """``k, v [T, Hkv, D]`` into both pools at ``slot_mapping [T]`` (int64; -1 skips a row), in one call: what
    :func:`pagedkv.kv.ops.write_kv` does with an ``index_copy_`` per pool, for every step of the kernel backend.
    The rows are fp32; an fp16 pool gets them rounded to nearest (ties to even), as ``Tensor.half()`` rounds."""
    portable.require("use the gather backend")
    # rows may be strided, a row's heads not (torch's GEMM can hand back a transposed view of k and v)
    k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (k, v))
    torch.ops.pagedkv.write_kv(k_pool, v_pool, slot_mapping, k, v)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for a contiguous fp32 ``gate_up [T, 2I]`` (gate first); returns ``[T, I]``."""
    portable.require("use kernels=False")
    return torch.ops.pagedkv.silu_mul(gate_up)


def rope_(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """``x * cos + roll(x, D/2) * sin_signed`` in place on fp32 ``x [T, H, D]`` (any row strides, unit stride
    in D); ``cos`` and ``sin_signed`` hold ``T * D`` contiguous values (e.g. ``[T, 1, D]``). Returns ``x``."""
    portable.require("use kernels=False")
    return torch.ops.pagedkv.rope_(x, cos, sin_signed)


def panel_rows(packed: Tensor, ids: Tensor, n: int, k: int, format_code: int) -> Tensor:
    """Rows ``ids`` (int64) of a packed weight as fp32, exactly (see :func:`pagedkv.model.panel.rows`)."""
    gemm.require("use kernels=False")
    return torch.ops.pagedkv.panel_rows(packed, ids, n, k, format_code)


def panel_linear(x: Tensor, packed: Tensor, n: int, k: int, format_code: int) -> Tensor:
    """The raw panel GEMM on a 2-D fp32 ``x`` (see :func:`pagedkv.model.panel.panel_linear`)."""
    gemm.require("use kernels=False")
    return torch.ops.pagedkv.panel_linear(x, packed, n, k, format_code)


def panel_linear_into(x: Tensor, packed: Tensor, n: int, k: int, format_code: int, y: Tensor, col: int) -> None:
    """The raw panel GEMM into columns ``[col, col + n)`` of a contiguous fp32 ``y [M, N]`` (see
    :func:`pagedkv.model.panel.panel_linear_into`)."""
    gemm.require("use kernels=False")
    torch.ops.pagedkv.panel_linear_into(x, packed, n, k, format_code, y, col)
