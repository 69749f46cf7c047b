"""The Python faces of the compiled ops in ``torch.ops.pagedkv`` (the libraries: :mod:`pagedkv.kernels`).

Each face first makes sure its library is loaded (a RuntimeError naming the option that avoids it, if it cannot
be), then checks what the C++ would reject with a vaguer message and skips conversions that would be no-ops
(each ``.to()`` costs microseconds, and these run a few hundred times a step). Where a library cannot be built,
the engine runs torch's ops instead, which the tests hold to the same numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedkv import kernels
from pagedkv.kv.ops import KV_DTYPES


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    window: int = 0,
) -> Tensor:
    """Causal ``softmax(q K^T * scale) V`` for every new row of a step, K/V read in place from the pool.

    q ``[T, Hq, D]`` (rows may be strided, as the q heads of a fused qkv row are); pools ``[num_blocks,
    block_size, Hkv, D]``, contiguous, fp32 or fp16 (read as fp32: the same bits as an fp32 pool holding
    those values); q fp32. Request ``b``'s rows are
    ``q[qsl[b]:qsl[b + 1]]`` (``query_start_loc [B + 1]``, from 0 to ``T``); row ``i`` sits at position
    ``seq_lens[b] - (qsl[b + 1] - i)`` and attends keys ``[0, position]``, whose K/V must be in the pool
    already, its own included; with ``window`` > 0 (a sliding-window layer) only keys ``(position - window,
    position]``. ``block_tables [B, max_blocks]`` padded with 0. Query head ``h`` uses KV head
    ``h // (Hq // Hkv)``. A decode is a request with one row.

    Batch invariant: a row gets the same bits whatever else is in the call, however its request's rows are
    split into calls, and on any thread count.
    """
    kernels.portable.require("use attention_backend='gather'")
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
        int(window),
    )


def _dense(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """``rms_norm(x) * weight``; with ``residual``: ``residual += x`` in place, then ``rms_norm(residual) * weight``.

    Contiguous 2-D fp32 ``x`` (and ``residual``) only.
    """
    kernels.portable.require("use kernels=False")
    return torch.ops.pagedkv.rms_norm(x, weight, eps, residual)


def write_kv(k_pool: Tensor, v_pool: Tensor, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """``k, v [T, Hkv, D]`` into both pools at ``slot_mapping [T]`` (int64; -1 skips a row), in one call: what
    :func:`pagedkv.kv.ops.write_kv` does with an ``index_copy_`` per pool, for every step of the kernel backend.
    The rows are fp32; an fp16 pool gets them rounded to nearest (ties to even), as ``Tensor.half()`` rounds."""
    kernels.portable.require("use the gather backend")
    # rows may be strided, a row's heads not (torch's GEMM can hand back a transposed view of k and v)
    k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (k, v))
    torch.ops.pagedkv.write_kv(k_pool, v_pool, slot_mapping, k, v)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for a contiguous fp32 ``gate_up [T, 2I]`` (gate first); returns ``[T, I]``."""
    kernels.portable.require("use kernels=False")
    return torch.ops.pagedkv.silu_mul(gate_up)


def rope_(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """``x * cos + roll(x, D/2) * sin_signed`` in place on fp32 ``x [T, H, D]`` (any row strides, unit stride
    in D); ``cos`` and ``sin_signed`` hold ``T * D`` contiguous values (e.g. ``[T, 1, D]``). Returns ``x``."""
    kernels.portable.require("use kernels=False")
    return torch.ops.pagedkv.rope_(x, cos, sin_signed)


def panel_rows(packed: Tensor, ids: Tensor, n: int, k: int, format_code: int) -> Tensor:
    """Rows ``ids`` (int64) of a packed weight as fp32, exactly (see :func:`pagedkv.model.panel.rows`)."""
    kernels.gemm.require("use kernels=False")
    return torch.ops.pagedkv.panel_rows(packed, ids, n, k, format_code)


def panel_linear(x: Tensor, packed: Tensor, n: int, k: int, format_code: int) -> Tensor:
    """The raw panel GEMM on a 2-D fp32 ``x`` (see :func:`pagedkv.model.panel.panel_linear`)."""
    kernels.gemm.require("use kernels=False")
    return torch.ops.pagedkv.panel_linear(x, packed, n, k, format_code)


def panel_linear_into(x: Tensor, packed: Tensor, n: int, k: int, format_code: int, y: Tensor, col: int) -> None:
    """The raw panel GEMM into columns ``[col, col + n)`` of a contiguous fp32 ``y [M, N]`` (see
    :func:`pagedkv.model.panel.panel_linear_into`)."""
    kernels.gemm.require("use kernels=False")
    torch.ops.pagedkv.panel_linear_into(x, packed, n, k, format_code, y, col)


def int8_linear(x: Tensor, blocks: Tensor, n: int, k: int, format_code: int) -> Tensor:
    """The int8-activation GEMM on a 2-D fp32 ``x`` (see :mod:`pagedkv.model.int8_linear`)."""
    kernels.gemm.require("use weight_format='gguf'")
    return torch.ops.pagedkv.int8_linear(x, blocks, n, k, format_code)


def int8_linear_into(x: Tensor, blocks: Tensor, n: int, k: int, format_code: int, y: Tensor, col: int) -> None:
    """The int8-activation GEMM into columns ``[col, col + n)`` of a contiguous fp32 ``y [M, N]``."""
    kernels.gemm.require("use weight_format='gguf'")
    torch.ops.pagedkv.int8_linear_into(x, blocks, n, k, format_code, y, col)
