"""AttentionMetadata: everything an attention layer needs to know about one engine step.

It is built once per step by the runner and passed explicitly to every layer (no global context), so all
index math -- slots, block tables, offsets -- happens once per step, not once per layer.

A step is a flat batch of ``T`` new tokens from ``B`` requests. Request ``i`` contributes
``query_lens[i]`` tokens at positions ``[seq_lens[i] - query_lens[i], seq_lens[i])``; the positions before
that are already in the pool (earlier steps or prefix-cache hits). Requests with one new token -- decodes,
and one-token prefill chunks, which need exactly the same math -- come first: ``num_decodes`` of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pagedkv.kv import ops


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor  # [T] int64: where each new token's K/V is written
    query_start_loc: Tensor  # [B + 1] int64: request i's new tokens are rows [qsl[i], qsl[i+1])
    seq_lens: Tensor  # [B] int64: context length after this step (cached + new)
    block_tables: Tensor  # [B, max_blocks] int64, padded with block 0 (never read past seq_len)
    num_decodes: int  # requests [0, num_decodes) have exactly one new token
    block_size: int
    query_start_loc_list: list[int]  # the same numbers as Python ints, for the per-request prefill loop
    seq_lens_list: list[int]
    prefill_kv_slots: Tensor  # [sum of prefill seq_lens] int64: whole contexts of the prefills, concatenated
    # per prefill request: None when it has no earlier context (plain causal attention), else a
    # [query_len, seq_len] bool mask in which new token i (position ctx + i) sees keys [0, ctx + i]
    prefill_masks: list[Tensor | None]
    _decode_index: tuple[Tensor, Tensor] | None = field(default=None, init=False, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    def decode_gather_index(self) -> tuple[Tensor, Tensor]:
        """:func:`decode_gather_index` of the decodes, built on the first call of the step, then reused."""
        if self._decode_index is None:
            n = self.num_decodes
            tables, seq_lens = self.block_tables[:n], self.seq_lens[:n]
            self._decode_index = decode_gather_index(tables, seq_lens, self.block_size)
        return self._decode_index

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_size: int,
    ) -> AttentionMetadata:
        """Flatten one step. Requests with ``query_len == 1`` must come first."""
        if not (len(block_tables) == len(query_lens) == len(seq_lens)):
            raise ValueError("block_tables, query_lens and seq_lens must have one entry per request")
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        if any(q == 1 for q in query_lens[num_decodes:]):
            raise ValueError("requests with one new token must come before the multi-token (prefill) ones")
        if any(q < 1 or s < q for q, s in zip(query_lens, seq_lens, strict=True)):
            raise ValueError("every request needs 1 <= query_len <= seq_len")
        starts = [s - q for q, s in zip(query_lens, seq_lens, strict=True)]
        query_start_loc_list = [0]
        for q in query_lens:
            query_start_loc_list.append(query_start_loc_list[-1] + q)
        prefill = slice(num_decodes, len(seq_lens))
        return cls(
            slot_mapping=ops.batched_slot_mapping(block_tables, starts, seq_lens, block_size),
            query_start_loc=torch.tensor(query_start_loc_list, dtype=torch.int64),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int64),
            block_tables=ops.pad_block_tables(block_tables),
            num_decodes=num_decodes,
            block_size=block_size,
            query_start_loc_list=query_start_loc_list,
            seq_lens_list=list(seq_lens),
            prefill_kv_slots=ops.batched_slot_mapping(
                block_tables[prefill], [0] * (len(seq_lens) - num_decodes), seq_lens[prefill], block_size
            ),
            prefill_masks=[_prefill_mask(q, s) for q, s in zip(query_lens[prefill], seq_lens[prefill], strict=True)],
        )


def _prefill_mask(query_len: int, seq_len: int) -> Tensor | None:
    context = seq_len - query_len
    if context == 0:
        return None
    return torch.arange(seq_len)[None, :] <= torch.arange(context, seq_len)[:, None]


def decode_gather_index(block_tables: Tensor, seq_lens: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Flat slots ``[B * max_len]`` of every decode's context, padded, and the mask ``[B, 1, 1, max_len]``.

    Gathering these slots with one ``index_select`` gives all contexts as ``[B, max_len, H, D]``. Padding
    positions point at the request's own last slot -- written this step, so always finite (a never-written
    pool row could hold NaN, and masked NaN still poisons ``softmax @ V``) -- and the mask hides them.
    """
    if seq_lens.numel() == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, 1, 1, 0, dtype=torch.bool)
    last = seq_lens[:, None] - 1
    positions = torch.arange(int(seq_lens.max()))[None, :]
    valid = positions <= last
    positions = torch.minimum(positions, last)
    slots = block_tables.gather(1, positions // block_size) * block_size + positions % block_size
    return slots.reshape(-1), valid[:, None, None, :]
