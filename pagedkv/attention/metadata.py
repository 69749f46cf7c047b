"""AttentionMetadata: everything an attention layer needs to know about one engine step.

It is built once per step by the runner and passed explicitly to every layer (no global context), so all
index math -- slots, block tables, offsets -- happens once per step, not once per layer.

A step is a flat batch of ``T`` new tokens from ``B`` requests. Request ``i`` contributes
``query_lens[i]`` tokens at positions ``[seq_lens[i] - query_lens[i], seq_lens[i])``; the positions before
that are already in the pool (earlier steps or prefix-cache hits). Requests with one new token -- decodes,
and one-token prefill chunks, which need exactly the same math -- come first: ``num_decodes`` of them (the
runner orders them so). Requests ``[first_gathered, B)`` are attended on a gathered copy of their contexts;
which ones is the backend's choice (:meth:`pagedkv.attention.backend.AttentionBackend.build_metadata`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedkv.kv import ops


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor  # [T] int64: where each new token's K/V is written
    seq_lens: Tensor  # [B] int64: context length after this step (cached + new)
    block_tables: Tensor  # [B, max_blocks] int64, padded with block 0 (never read past seq_len)
    num_decodes: int  # requests [0, num_decodes) have exactly one new token
    query_start_loc: list[int]  # [B + 1]: request i's new tokens are rows [qsl[i], qsl[i+1])
    seq_lens_list: list[int]  # seq_lens as Python ints, for the per-request loop
    first_gathered: int  # requests [first_gathered, B) attend on a gather of their contexts
    context_slots: Tensor  # [sum of their seq_lens] int64: those whole contexts, concatenated
    # per gathered request: None when it sees every key of its context (one new token) or its chunk is plain
    # causal (no earlier context), else a [query_len, seq_len] bool mask in which new token i (position
    # context + i) sees keys [0, context + i]
    context_masks: list[Tensor | None]

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_list)

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_size: int,
        gather_decodes: bool,
    ) -> AttentionMetadata:
        """Flatten one step. Requests with ``query_len == 1`` must come first; ``gather_decodes`` says whether
        they are attended on gathered contexts too (else only the multi-token ones are)."""
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
        query_start_loc = [0]
        for q in query_lens:
            query_start_loc.append(query_start_loc[-1] + q)
        first = 0 if gather_decodes else num_decodes
        gathered = slice(first, len(seq_lens))
        return cls(
            slot_mapping=ops.batched_slot_mapping(block_tables, starts, seq_lens, block_size),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int64),
            block_tables=ops.pad_block_tables(block_tables),
            num_decodes=num_decodes,
            query_start_loc=query_start_loc,
            seq_lens_list=list(seq_lens),
            first_gathered=first,
            context_slots=ops.batched_slot_mapping(
                block_tables[gathered], [0] * (len(seq_lens) - first), seq_lens[gathered], block_size
            ),
            context_masks=[_mask(q, s) for q, s in zip(query_lens[gathered], seq_lens[gathered], strict=True)],
        )


def _mask(query_len: int, seq_len: int) -> Tensor | None:
    context = seq_len - query_len
    if context == 0 or query_len == 1:
        return None
    return torch.arange(seq_len)[None, :] <= torch.arange(context, seq_len)[:, None]
