"""Slot math, scatter (write) and gather (read) on the paged KV pool.

A pool holds one layer's K (or V): ``[num_blocks, block_size, num_kv_heads, head_dim]``. Viewed flat it is
``[num_blocks * block_size, num_kv_heads, head_dim]`` and the token at position ``p`` of a request lives in
row ``block_table[p // block_size] * block_size + p % block_size`` -- its *slot*. Moving K/V is then one
``index_copy_`` (write) or one ``index_select`` (read) on that flat view, whatever the number of blocks.

``gather_kv_loop`` and ``gather_kv_indexed`` are the tutorial's two versions (step 14.2), kept as named
references for tests and benchmarks; the engine never calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

PAD_SLOT = -1
_INDEX_DTYPES = (torch.int32, torch.int64)


def flat_view(pool: Tensor) -> Tensor:
    """``[num_blocks, block_size, H, D]`` -> ``[num_blocks * block_size, H, D]`` without a copy."""
    if pool.dim() != 4:
        raise ValueError(f"pool must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(pool.shape)}")
    return pool.view(-1, pool.shape[2], pool.shape[3])


def _as_index_tensor(block_table: Sequence[int] | Tensor, name: str = "block_table") -> Tensor:
    if isinstance(block_table, Tensor):
        if block_table.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must hold int32 or int64 indices, got {block_table.dtype}")
        return block_table.to(torch.int64)
    return torch.tensor(list(block_table), dtype=torch.int64)


def _check_blocks(table: Tensor, num_blocks: int) -> None:
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_blocks):
        raise ValueError(
            f"block ids must lie in [0, {num_blocks}) for this pool, got range "
            f"[{int(table.min())}, {int(table.max())}]"
        )


def _check_seq_len(seq_len: int, num_table_blocks: int, block_size: int) -> None:
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    if seq_len > num_table_blocks * block_size:
        raise ValueError(
            f"seq_len {seq_len} needs {-(-seq_len // block_size)} blocks but the block table has only "
            f"{num_table_blocks} (block_size {block_size}): allocate more blocks or pass a shorter seq_len"
        )


def slot_mapping(block_table: Sequence[int] | Tensor, start: int, end: int, block_size: int) -> Tensor:
    """Flat slot ids (int64) of positions ``[start, end)`` of one request."""
    table = _as_index_tensor(block_table)
    if start < 0 or end < start:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    _check_seq_len(end, table.numel(), block_size)
    positions = torch.arange(start, end, dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def batched_slot_mapping(
    block_tables: Sequence[Sequence[int]], starts: Sequence[int], ends: Sequence[int], block_size: int
) -> Tensor:
    """Concatenated flat slots of positions ``[starts[i], ends[i])`` of many requests, in one pass.

    Each request's block table is padded into one ``[B, max_blocks]`` tensor, so the slot math runs
    once for the whole batch instead of once per request.
    """
    if not (len(block_tables) == len(starts) == len(ends)):
        raise ValueError("block_tables, starts and ends must have the same length")
    if not block_tables:
        return torch.empty(0, dtype=torch.int64)
    for table, start, end in zip(block_tables, starts, ends):
        if start < 0 or end < start:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        _check_seq_len(end, len(table), block_size)
    tables = pad_block_tables(block_tables)
    counts = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(block_tables)), counts)
    offsets = torch.repeat_interleave(torch.tensor(list(starts), dtype=torch.int64) - _exclusive_cumsum(counts), counts)
    positions = torch.arange(int(counts.sum()), dtype=torch.int64) + offsets
    return tables[rows, positions // block_size] * block_size + positions % block_size


def _exclusive_cumsum(counts: Tensor) -> Tensor:
    return torch.cumsum(counts, 0) - counts


def pad_block_tables(block_tables: Sequence[Sequence[int]], width: int | None = None) -> Tensor:
    """``[B, width]`` int64 tensor of block tables, padded with 0 (a valid id that is never read)."""
    width = max((len(t) for t in block_tables), default=0) if width is None else width
    out = torch.zeros(len(block_tables), max(width, 1), dtype=torch.int64)
    for i, table in enumerate(block_tables):
        if table:
            out[i, : len(table)] = torch.as_tensor(table, dtype=torch.int64)
    return out


def write_kv(pool: Tensor, slot_mapping: Tensor, values: Tensor) -> None:
    """Scatter ``values [T, H, D]`` into the pool at ``slot_mapping [T]`` with one ``index_copy_``.

    Slots of -1 (padding) are skipped: their rows are filtered out first, so the pool is never touched
    there. The common case, no padding, takes no extra copy.
    """
    flat = flat_view(pool)
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping must hold int32 or int64 indices, got {slot_mapping.dtype}")
    if values.dim() != 3 or values.shape[1:] != flat.shape[1:]:
        raise ValueError(
            f"values must be [num_tokens, {flat.shape[1]}, {flat.shape[2]}] to match the pool, got {tuple(values.shape)}"
        )
    if values.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"{values.shape[0]} value rows but {slot_mapping.shape[0]} slots: they must be equal")
    if values.dtype != pool.dtype:
        raise ValueError(f"values dtype {values.dtype} differs from pool dtype {pool.dtype}: cast before writing")
    slots = slot_mapping.to(torch.int64)
    if slots.numel() == 0:
        return
    if int(slots.min()) < 0:
        keep = slots != PAD_SLOT
        if bool((slots[~keep] != PAD_SLOT).any()):
            raise ValueError("slot_mapping may hold -1 for padding but no other negative slot")
        slots, values = slots[keep], values[keep]
    if slots.numel() and int(slots.max()) >= flat.shape[0]:
        raise ValueError(f"slot {int(slots.max())} is beyond the pool's {flat.shape[0]} slots")
    flat.index_copy_(0, slots, values)


def gather_kv(
    pool: Tensor, block_table: Sequence[int] | Tensor, seq_len: int, block_size: int, out: Tensor | None = None
) -> Tensor:
    """Read positions ``[0, seq_len)`` of one request: ``[seq_len, H, D]``, one ``index_select``."""
    table = _as_index_tensor(block_table)
    _check_seq_len(seq_len, table.numel(), block_size)
    _check_blocks(table[: -(-seq_len // block_size)], pool.shape[0])
    if pool.shape[1] != block_size:
        raise ValueError(f"pool has block_size {pool.shape[1]} but block_size={block_size} was passed")
    return gather_slots(pool, slot_mapping(table, 0, seq_len, block_size), out=out)


def gather_slots(pool: Tensor, slots: Tensor, out: Tensor | None = None) -> Tensor:
    """Rows ``slots`` of the flat pool: ``[len(slots), H, D]``; ``out=`` reuses a buffer of that shape."""
    flat = flat_view(pool)
    if out is None:
        return flat.index_select(0, slots)
    return torch.index_select(flat, 0, slots, out=out)


def batched_gather_kv(
    pool: Tensor,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    block_size: int,
    out: Tensor | None = None,
) -> Tensor:
    """Read many requests at once: their contexts concatenated, ``[sum(seq_lens), H, D]``."""
    for table in block_tables:
        _check_blocks(torch.as_tensor(list(table), dtype=torch.int64), pool.shape[0])
    slots = batched_slot_mapping(block_tables, [0] * len(seq_lens), list(seq_lens), block_size)
    return gather_slots(pool, slots, out=out)


def gather_kv_loop(pool: Tensor, block_table: Sequence[int], seq_len: int, block_size: int) -> Tensor:
    """Tutorial v1 (reference only): a Python loop over blocks, then ``torch.cat``."""
    _check_seq_len(seq_len, len(block_table), block_size)
    chunks = []
    remaining = seq_len
    for block_id in block_table:
        if remaining <= 0:
            break
        take = min(block_size, remaining)
        chunks.append(pool[int(block_id), :take])
        remaining -= take
    if not chunks:
        return pool.new_empty((0, pool.shape[2], pool.shape[3]))
    return torch.cat(chunks, dim=0)


def gather_kv_indexed(pool: Tensor, block_table: Sequence[int], seq_len: int, block_size: int) -> Tensor:
    """Tutorial v2 (reference only): two-tensor advanced indexing ``pool[blocks, offsets]``."""
    _check_seq_len(seq_len, len(block_table), block_size)
    positions = torch.arange(seq_len)
    table = torch.as_tensor(list(block_table), dtype=torch.int64)
    return pool[table[positions // block_size], positions % block_size]
