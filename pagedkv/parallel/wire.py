"""One step's inputs as flat int64 tensors, so rank 0 can broadcast them to the tensor-parallel workers.

Two broadcasts a step: a fixed-size header (what comes, and how many of each) on the long-timeout group --
the idle worker waits there -- then one payload tensor holding every list back to back. Only ids, lengths
and row numbers travel, never request objects: a worker knows nothing of requests, it runs the same flat
step as rank 0 (``ModelRunner.run``).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from pagedkv.engine.step_inputs import ScoredRange, StepInputs
from pagedkv.parallel.group import TensorParallel

STEP, STOP = 1, 0
_HEADER = 11  # opcode, then the lengths of the ten lists below
_SCORED_FIELDS = 5  # index, first_row, first_position, count, top


def send_step(tp: TensorParallel, inputs: StepInputs) -> None:
    scored = [v for r in inputs.scored for v in (r.index, r.first_row, r.first_position, len(r.targets), r.top)]
    lists = [
        inputs.input_ids,
        inputs.positions,
        inputs.query_lens,
        inputs.seq_lens,
        [len(t) for t in inputs.block_tables],
        [b for t in inputs.block_tables for b in t],
        inputs.sampled_rows,
        inputs.shared_rows,
        scored,
        [t for r in inputs.scored for t in r.targets],
    ]
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = STEP
    header[1 : 1 + len(lists)] = torch.tensor([len(x) for x in lists])
    tp.broadcast(header, idle=True)
    tp.broadcast(torch.tensor([v for x in lists for v in x], dtype=torch.int64))


def send_stop(tp: TensorParallel) -> None:
    tp.broadcast(torch.zeros(_HEADER, dtype=torch.int64), idle=True)


def receive_step(tp: TensorParallel) -> StepInputs | None:
    """The next step from rank 0, or None when rank 0 says stop."""
    header = tp.broadcast(torch.zeros(_HEADER, dtype=torch.int64), idle=True)
    if int(header[0]) == STOP:
        return None
    sizes = header[1:].tolist()
    payload = tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64)).tolist()
    ends = list(accumulate(sizes))
    ids, positions, query_lens, seq_lens, table_lens, tables, sampled, shared, scored, targets = (
        payload[end - size : end] for size, end in zip(sizes, ends, strict=True)
    )
    block_tables = [tables[end - n : end] for n, end in zip(table_lens, accumulate(table_lens), strict=True)]
    ranges, start = [], 0
    for i in range(0, len(scored), _SCORED_FIELDS):
        index, first_row, first_position, count, top = scored[i : i + _SCORED_FIELDS]
        ranges.append(ScoredRange(index, first_row, first_position, top, targets[start : start + count]))
        start += count
    return StepInputs(ids, positions, block_tables, query_lens, seq_lens, sampled, shared, ranges)
