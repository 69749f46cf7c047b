"""Lists of ints from rank 0 to the tensor-parallel workers: how one step's inputs travel. What the lists
mean is the engine's (``StepInputs.to_wire`` in engine/step_inputs.py); this module only moves them.

Two broadcasts a message: a fixed-size header (what comes, and how long each list is) on the long-timeout
group -- the idle worker waits there -- then one payload tensor holding every list back to back.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from pagedkv.parallel.group import TensorParallel

STEP, STOP = 1, 0
MAX_LISTS = 12
_HEADER = 2 + MAX_LISTS  # opcode, the number of lists, then their lengths


def send_lists(tp: TensorParallel, lists: Sequence[Sequence[int]]) -> None:
    if len(lists) > MAX_LISTS:
        raise ValueError(f"{len(lists)} lists in one message, at most {MAX_LISTS}: raise wire.MAX_LISTS")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = STEP, len(lists)
    header[2 : 2 + len(lists)] = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    tp.broadcast(header, idle=True)
    tp.broadcast(torch.tensor([v for x in lists for v in x], dtype=torch.int64))


def send_stop(tp: TensorParallel) -> None:
    tp.broadcast(torch.zeros(_HEADER, dtype=torch.int64), idle=True)


def receive_lists(tp: TensorParallel) -> list[list[int]] | None:
    """The next message's lists from rank 0, or None when rank 0 says stop."""
    header = tp.broadcast(torch.zeros(_HEADER, dtype=torch.int64), idle=True)
    if int(header[0]) == STOP:
        return None
    sizes = header[2 : 2 + int(header[1])].tolist()
    payload = tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64)).tolist()
    return [payload[end - size : end] for size, end in zip(sizes, accumulate(sizes), strict=True)]
