"""StepInputs: one model step as flat lists -- what the runner builds from a scheduled step, what the model
runs, and what rank 0 sends to tensor-parallel workers (as lists of ints, ``to_wire``, which
``pagedkv.parallel.wire`` broadcasts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

_SCORED_FIELDS = 5  # a ScoredRange on the wire: index, first_row, first_position, count, top; then its targets


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

    def to_wire(self) -> list[list[int]]:
        """What a tensor-parallel worker receives: only ids, lengths and row numbers, never request objects --
        a worker knows nothing of requests, it runs the same flat step as rank 0 (``ModelRunner.run``)."""
        scored = [v for r in self.scored for v in (r.index, r.first_row, r.first_position, len(r.targets), r.top)]
        return [
            self.input_ids,
            self.positions,
            self.query_lens,
            self.seq_lens,
            [len(t) for t in self.block_tables],
            [b for t in self.block_tables for b in t],
            self.sampled_rows,
            self.shared_rows,
            scored,
            [t for r in self.scored for t in r.targets],
        ]

    @classmethod
    def from_wire(cls, lists: list[list[int]]) -> StepInputs:
        """The step ``to_wire`` sent (without the pooled rows, rank 0's alone)."""
        ids, positions, query_lens, seq_lens, table_lens, tables, sampled, shared, scored, targets = lists
        block_tables = [tables[end - n : end] for n, end in zip(table_lens, accumulate(table_lens), strict=True)]
        ranges, start = [], 0
        for i in range(0, len(scored), _SCORED_FIELDS):
            index, first_row, first_position, count, top = scored[i : i + _SCORED_FIELDS]
            ranges.append(ScoredRange(index, first_row, first_position, top, targets[start : start + count]))
            start += count
        return cls(ids, positions, block_tables, query_lens, seq_lens, sampled, shared, ranges)
