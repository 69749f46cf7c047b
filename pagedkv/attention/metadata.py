"""AttentionMetadata: everything an attention layer needs to know about one engine step.

It is built once per step by the runner and passed explicitly to every layer (no global context), so all
index math -- slots, block tables, offsets -- happens once per step, not once per layer.

A step is a flat batch of ``T`` new tokens from ``B`` requests, in any order. Request ``i`` contributes
``query_lens[i]`` tokens -- rows ``[query_start_loc[i], query_start_loc[i + 1])`` -- at positions
``[seq_lens[i] - query_lens[i], seq_lens[i])``; the positions before that are already in the pool (earlier
steps or prefix-cache hits). A decode is a request with one new token, nothing more special.
:class:`GatherMetadata` adds what the torch backend precomputes to copy contexts out of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from torch import Tensor

from pagedkv.kv import ops


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor  # [T] int64: where each new token's K/V is written
    block_tables: Tensor  # [B, max_blocks] int64, padded with block 0 (never read past seq_len)
    seq_lens: Tensor  # [B] int64: context length after this step (cached + new)
    query_start_loc: Tensor  # [B + 1] int64: request i's new tokens are rows [qsl[i], qsl[i + 1])

    @classmethod
    def build(
        cls, block_tables: Sequence[Sequence[int]], query_lens: Sequence[int], seq_lens: Sequence[int], block_size: int
    ) -> AttentionMetadata:
        """Flatten one step: each request's block table, number of new tokens and context length after them."""
        return cls(**_step_fields(block_tables, query_lens, seq_lens, block_size))


@dataclass(slots=True)
class GatherMetadata(AttentionMetadata):
    """The step, plus the whole contexts the torch backend gathers and its per-request loop's bounds."""

    query_start_list: list[int]  # query_start_loc as Python ints
    seq_lens_list: list[int]  # seq_lens as Python ints
    context_slots: Tensor  # [sum of seq_lens] int64: every request's whole context, concatenated
    # per request: None when it sees every key of its context (one new token) or its chunk is plain causal (no
    # earlier context), else a [query_len, seq_len] bool mask in which new token j (position context + j)
    # sees keys [0, context + j]
    context_masks: list[Tensor | None]
    # window -> per request (keys skipped at the start of its context, mask over the rest): made by window_views
    _window_views: dict[int, list[tuple[int, Tensor | None]]] = field(default_factory=dict)

    def window_views(self, window: int) -> list[tuple[int, Tensor | None]]:
        """Per request, what a sliding-window layer of ``window`` attends to: the number of context keys no query
        of this step can see (they are skipped), and the mask over the remaining keys (None: each query sees all
        of them, or plain causal for a chunk that starts at position 0). Made once a step per window size."""
        views = self._window_views.get(window)
        if views is None:
            views = self._window_views[window] = [
                _window_view(q_end - q_start, s, window, causal)
                for q_start, q_end, s, causal in zip(
                    self.query_start_list, self.query_start_list[1:], self.seq_lens_list, self.context_masks
                )
            ]
        return views

    @classmethod
    def build(
        cls, block_tables: Sequence[Sequence[int]], query_lens: Sequence[int], seq_lens: Sequence[int], block_size: int
    ) -> GatherMetadata:
        fields = _step_fields(block_tables, query_lens, seq_lens, block_size)
        return cls(
            **fields,
            query_start_list=[0, *accumulate(query_lens)],
            seq_lens_list=list(seq_lens),
            context_slots=ops.batched_slot_mapping(block_tables, [0] * len(seq_lens), seq_lens, block_size),
            context_masks=[_mask(q, s) for q, s in zip(query_lens, seq_lens, strict=True)],
        )


def _step_fields(
    block_tables: Sequence[Sequence[int]], query_lens: Sequence[int], seq_lens: Sequence[int], block_size: int
) -> dict[str, Tensor]:
    if not (len(block_tables) == len(query_lens) == len(seq_lens)):
        raise ValueError("block_tables, query_lens and seq_lens must have one entry per request")
    if any(q < 1 or s < q for q, s in zip(query_lens, seq_lens, strict=True)):
        raise ValueError("every request needs 1 <= query_len <= seq_len")
    starts = [s - q for q, s in zip(query_lens, seq_lens, strict=True)]
    return {
        "slot_mapping": ops.batched_slot_mapping(block_tables, starts, seq_lens, block_size),
        "block_tables": ops.pad_block_tables(block_tables),
        "seq_lens": torch.tensor(list(seq_lens), dtype=torch.int64),
        "query_start_loc": torch.tensor([0, *accumulate(query_lens)], dtype=torch.int64),
    }


def _mask(query_len: int, seq_len: int) -> Tensor | None:
    context = seq_len - query_len
    if context == 0 or query_len == 1:
        return None
    return torch.arange(seq_len)[None, :] <= torch.arange(context, seq_len)[:, None]


def _window_view(query_len: int, seq_len: int, window: int, causal: Tensor | None) -> tuple[int, Tensor | None]:
    """New token j (position ``context + j``) sees keys (context + j - window, context + j]; keys before the
    first query's window are dropped, so the mask covers ``[first, seq_len)``."""
    context = seq_len - query_len
    if seq_len <= window:  # every key is within every query's window: the causal view
        return 0, causal
    first = max(0, context - window + 1)
    if query_len == 1:
        return first, None
    keys = torch.arange(first, seq_len)[None, :]
    positions = torch.arange(context, seq_len)[:, None]
    return first, (keys <= positions) & (keys > positions - window)
