"""Slot math, scatter (write) and gather (read) on the paged KV pool.

A pool holds one layer's K (or V): ``[num_blocks, block_size, num_kv_heads, head_dim]``. Viewed flat it is
``[num_blocks * block_size, num_kv_heads, head_dim]`` and the token at position ``p`` of a request lives in
row ``block_table[p // block_size] * block_size + p % block_size`` -- its *slot*. Moving K/V is then one
``index_copy_`` (write) or one ``index_select`` (read), whatever the number of blocks: on the flat view by
slot.

Whole-context reads that only tests and benchmarks use (the tutorial's three versions among them) are in
:mod:`pagedkv.kv.reference`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

PAD_SLOT = -1
# The pool's element types (config.KV_CACHE_DTYPES, the names). float32 is the default and the exact one; float16 halves
# the pool (llama.cpp's default KV type): each K/V value is rounded to fp16 once, when it is written, and every read
# widens it back to fp32, so attention's arithmetic stays fp32 and only the stored values differ.
# (docs/architecture.md keeps the pool fp32 because bf16 *attention* -- SDPA computing in bf16 -- was 6-10x slower; an
# fp16 pool read by the fp32 kernel is not that: its decodes ran 1.1-1.5x faster than on fp32 pools, see
# benchmarks/attention.py.) A value past fp16's range (65504) is stored as inf, as in llama.cpp's fp16 cache.
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}
_INDEX_DTYPES = (torch.int32, torch.int64)


def flat_view(pool: Tensor) -> Tensor:
    """``[num_blocks, block_size, H, D]`` -> ``[num_blocks * block_size, H, D]`` without a copy."""
    if pool.dim() != 4:
        raise ValueError(
            f"pool must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(pool.shape)}"
        )
    return pool.view(-1, pool.shape[2], pool.shape[3])


def index_array(indices: Sequence[int] | Tensor) -> np.ndarray:
    """1-D int64 numpy array of ``indices``.

    Index math on a few hundred ints is 3-5x cheaper in numpy than in torch, where each op pays a
    dispatch of several microseconds; results go back with ``torch.from_numpy``, which does not copy.
    """
    if isinstance(indices, Tensor):
        if indices.dtype not in _INDEX_DTYPES:
            raise ValueError(f"block_table must hold int32 or int64 indices, got {indices.dtype}")
        array = indices.cpu().numpy()
    elif len(indices) == 0:
        return np.empty(0, dtype=np.int64)
    else:
        array = np.asarray(indices)
        if array.dtype.kind not in "iu":
            raise ValueError(f"block_table must be a sequence of ints, got elements of numpy dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"block_table must be 1-D, got shape {array.shape}")
    return array.astype(np.int64, copy=False)


def check_seq_len(seq_len: int, num_table_blocks: int, block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    if seq_len > num_table_blocks * block_size:
        raise ValueError(
            f"seq_len {seq_len} needs {-(-seq_len // block_size)} blocks but the block table has only "
            f"{num_table_blocks} (block_size {block_size}): allocate more blocks or pass a shorter seq_len"
        )


def slot_mapping(block_table: Sequence[int] | Tensor, start: int, end: int, block_size: int) -> Tensor:
    """Flat slot ids (int64) of positions ``[start, end)`` of one request.

    Built per block, not per position: the covered blocks' slots are ``block_id * block_size + [0, bs)``,
    one broadcast, then cut to ``[start, end)``. Only the covered part of the table is converted.
    """
    if start < 0 or end < start:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    check_seq_len(end, len(block_table), block_size)
    first = start // block_size
    blocks = index_array(block_table[first : -(-end // block_size)])
    slots = (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)
    return torch.from_numpy(slots[start - first * block_size : end - first * block_size])


def batched_slot_mapping(
    block_tables: Sequence[Sequence[int]], starts: Sequence[int], ends: Sequence[int], block_size: int
) -> Tensor:
    """Concatenated flat slots of positions ``[starts[i], ends[i])`` of many requests, in one pass.

    The block tables are padded into one ``[B, max_blocks]`` array, so the slot math runs once for the
    whole batch instead of once per request.
    """
    if not (len(block_tables) == len(starts) == len(ends)):
        raise ValueError("block_tables, starts and ends must have the same length")
    for table, start, end in zip(block_tables, starts, ends, strict=True):
        if start < 0 or end < start:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        check_seq_len(end, len(table), block_size)
    first = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(ends, dtype=np.int64) - first
    rows = np.repeat(np.arange(len(block_tables)), counts)
    # Output row j of request r holds position starts[r] + (j - index of r's first output row).
    positions = np.arange(counts.sum()) + np.repeat(first - (np.cumsum(counts) - counts), counts)
    tables = pad_block_tables(block_tables).numpy()
    return torch.from_numpy(tables[rows, positions // block_size] * block_size + positions % block_size)


def pad_block_tables(block_tables: Sequence[Sequence[int]], width: int | None = None) -> Tensor:
    """``[B, width]`` int64 tensor of block tables, padded with 0 (a valid id that is never read)."""
    width = max((len(t) for t in block_tables), default=0) if width is None else width
    out = np.zeros((len(block_tables), max(width, 1)), dtype=np.int64)
    for i, table in enumerate(block_tables):
        out[i, : len(table)] = table
    return torch.from_numpy(out)


def write_kv(pool: Tensor, slot_mapping: Tensor, values: Tensor) -> None:
    """Scatter ``values [T, H, D]`` into the pool at ``slot_mapping [T]`` with one ``index_copy_``.

    Slots of -1 (padding) are skipped: their rows are filtered out first, so the pool is never touched
    there. The common case, no padding, takes no extra copy and one ``aminmax`` for the range check.
    """
    flat = flat_view(pool)
    if slot_mapping.dtype not in _INDEX_DTYPES or slot_mapping.dim() != 1:
        raise ValueError(
            f"slot_mapping must be a 1-D int32 or int64 tensor, got {slot_mapping.dtype} "
            f"of shape {tuple(slot_mapping.shape)}"
        )
    if values.dim() != 3 or values.shape[1:] != flat.shape[1:]:
        raise ValueError(
            f"values must be [num_tokens, {flat.shape[1]}, {flat.shape[2]}] to match the pool, "
            f"got {tuple(values.shape)}"
        )
    if values.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"{values.shape[0]} value rows but {slot_mapping.shape[0]} slots: make them equal")
    if values.dtype != pool.dtype and not (values.dtype == torch.float32 and pool.dtype in KV_DTYPES.values()):
        raise ValueError(f"values dtype {values.dtype} differs from pool dtype {pool.dtype}: cast first")
    slots = slot_mapping.to(torch.int64)
    if slots.numel() == 0:
        return
    low, high = (int(x) for x in torch.aminmax(slots))
    if high >= flat.shape[0]:
        raise ValueError(f"slot {high} is beyond the pool's {flat.shape[0]} slots")
    if low < 0:
        keep = slots != PAD_SLOT
        if low < PAD_SLOT:
            raise ValueError(f"slot_mapping may hold -1 for padding but no other negative slot, got {low}")
        slots, values = slots[keep], values[keep]
    flat.index_copy_(0, slots, values.to(pool.dtype))  # an fp32 row into an fp16 pool: rounded to nearest


def _check_out(out: Tensor, pool: Tensor, rows: int) -> None:
    expected = (rows, pool.shape[2], pool.shape[3])
    if tuple(out.shape) != expected or out.dtype != pool.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {pool.dtype} tensor of shape {expected}, "
            f"got {out.dtype} {tuple(out.shape)} (contiguous={out.is_contiguous()})"
        )


def gather_slots(pool: Tensor, slots: Tensor, out: Tensor | None = None) -> Tensor:
    """Rows ``slots`` of the flat pool: ``[len(slots), H, D]``; ``out=`` reuses a buffer of that shape.

    This is the per-layer read: the slots are computed once per step, so only attribute checks run
    here; ``index_select`` rejects out-of-range slots itself, and that error is turned into ours.
    """
    flat = flat_view(pool)
    if slots.dtype not in _INDEX_DTYPES or slots.dim() != 1:
        raise ValueError(f"slots must be a 1-D int32 or int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    if out is not None:
        _check_out(out, pool, slots.shape[0])
    try:
        return flat.index_select(0, slots) if out is None else torch.index_select(flat, 0, slots, out=out)
    except IndexError as error:
        raise ValueError(
            f"slot ids must lie in [0, {flat.shape[0]}) for this pool: build them from block tables "
            "allocated from this pool (padding slots -1 are for writes only)"
        ) from error
