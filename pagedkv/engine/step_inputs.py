"""StepInputs: one model step as flat lists -- what the runner builds from a scheduled step, what the model
runs, and what rank 0 sends to tensor-parallel workers (``pagedkv.parallel.wire``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScoredRange:
    """The rows of one request that score its prompt: row ``first_row + i`` scores ``targets[i]``, the
    token at position ``first_position + i``."""

    index: int  # in step.scheduled
    first_row: int
    first_position: int
    top: int
    targets: list[int]


@dataclass(slots=True)
class PooledRange:
    """Rows ``first_row .. first_row + count`` of one request are the final hidden states of positions
    ``first_position ..`` that its pooling keeps (``pagedkv.engine.pooling``)."""

    index: int  # in step.scheduled
    first_row: int
    first_position: int
    count: int


@dataclass(slots=True)
class StepInputs:
    """One step as flat lists: all the model needs, and all a tensor-parallel worker receives."""

    input_ids: list[int]
    positions: list[int]
    block_tables: list[list[int]]
    query_lens: list[int]
    seq_lens: list[int]
    sampled_rows: list[int]  # rows whose logits are sampled, in order
    shared_rows: list[int]  # rows whose K/V is already in a shared cached block (not written again)
    scored: list[ScoredRange]
    # rank 0's alone (not sent to tensor-parallel workers): pooled rows only select final hidden states, which
    # every rank holds whole, so no collective depends on them
    pooled: list[PooledRange] = field(default_factory=list)
    # the windowed layers' block tables, one per request, where the KV manager keeps them apart (sliding-window
    # layers: pagedkv.kv.hybrid); empty otherwise
    window_block_tables: list[list[int]] = field(default_factory=list)
