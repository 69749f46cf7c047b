"""Reference reads of the KV pool, for tests and benchmarks: the engine never calls them.

The tutorial's three versions of reading one request's context (step 14.2): ``gather_kv_loop`` (a Python
loop over blocks, then ``torch.cat``), ``gather_kv_indexed`` (``pool[blocks, offsets]``) and ``gather_kv``
(one ``index_select`` on the block dimension), the first two 3-9x slower than the third
(``benchmarks/gather.py``, docs/performance.md). The engine reads per layer with ``ops.gather_slots`` on slots
computed once a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedkv.kv import ops


def check_blocks(blocks: Sequence[int] | Tensor, num_blocks: int) -> None:
    """Raise if a block id is outside the pool; called on error paths only, to name the bad range."""
    array = ops.index_array(blocks)
    low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
    if low < 0 or high >= num_blocks:
        raise ValueError(
            f"block ids must lie in [0, {num_blocks}) for this pool, got range [{low}, {high}]: "
            "pass a block table allocated from this pool"
        )


def check_pool(pool: Tensor, block_size: int) -> None:
    if pool.dim() != 4 or pool.shape[1] != block_size:
        raise ValueError(
            f"pool must be [num_blocks, block_size={block_size}, num_kv_heads, head_dim], got shape {tuple(pool.shape)}"
        )


def gather_kv(pool: Tensor, block_table: Sequence[int] | Tensor, seq_len: int, block_size: int) -> Tensor:
    """Tutorial v3 (reference only): positions ``[0, seq_len)`` of one request, ``[seq_len, H, D]``.

    Whole blocks are copied with one ``index_select`` on the block dimension, then viewed flat and cut
    to ``seq_len`` (a prefix view, still contiguous). That moves ``block_size`` times fewer indices than
    per-token slots and needs no slot math, so a call runs near memcpy speed; the price is copying the
    unused tail of the last block. Block ids are range-checked by ``index_select`` itself (it rejects
    negative and too-large ids), so the success path pays for no reduction over the table.
    """
    check_pool(pool, block_size)
    ops.check_seq_len(seq_len, len(block_table), block_size)
    blocks = block_table[: -(-seq_len // block_size)]
    if not (isinstance(blocks, Tensor) and blocks.dtype == torch.int64 and blocks.dim() == 1):
        blocks = torch.from_numpy(ops.index_array(blocks))  # a 1-D int64 tensor is used as it is
    try:
        gathered = pool.index_select(0, blocks).view(-1, pool.shape[2], pool.shape[3])
    except IndexError:
        check_blocks(blocks, pool.shape[0])
        raise
    return gathered if gathered.shape[0] == seq_len else gathered[:seq_len]


def gather_kv_loop(pool: Tensor, block_table: Sequence[int], seq_len: int, block_size: int) -> Tensor:
    """Tutorial v1 (reference only): a Python loop over blocks, then ``torch.cat``."""
    ops.check_seq_len(seq_len, len(block_table), block_size)
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
    ops.check_seq_len(seq_len, len(block_table), block_size)
    positions = torch.arange(seq_len)
    table = torch.as_tensor(list(block_table), dtype=torch.int64)
    return pool[table[positions // block_size], positions % block_size]
