"""Reference reads of the KV pool, for tests and benchmarks: the engine never calls them.

``gather_kv_loop`` and ``gather_kv_indexed`` are the tutorial's two versions (step 14.2), 3-9x slower than
the one ``index_select`` of :func:`pagedkv.kv.ops.gather_kv` (see ``benchmarks/gather.py``); they check their
inputs with ops' own checks. ``batched_gather_kv`` is the engine's own per-step read (``batched_slot_mapping``
+ ``gather_slots``) as one call, so tests can compare it with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedkv.kv import ops


def batched_gather_kv(
    pool: Tensor,
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    block_size: int,
    out: Tensor | None = None,
) -> Tensor:
    """Read many requests at once: their contexts concatenated, ``[sum(seq_lens), H, D]``.

    Like ``gather_kv``, only the blocks that hold the first ``seq_lens[i]`` tokens are read, and they
    are range-checked only when the read fails, to name the bad block id.
    """
    ops.check_pool(pool, block_size)
    if len(block_tables) != len(seq_lens):
        raise ValueError(f"{len(block_tables)} block tables but {len(seq_lens)} seq_lens: give one each")
    slots = ops.batched_slot_mapping(block_tables, [0] * len(seq_lens), list(seq_lens), block_size)
    try:
        return ops.gather_slots(pool, slots, out=out)
    except ValueError:
        for table, seq_len in zip(block_tables, seq_lens, strict=True):
            ops.check_blocks(table[: -(-seq_len // block_size)], pool.shape[0])
        raise


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
