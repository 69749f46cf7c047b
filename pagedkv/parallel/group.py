"""TensorParallel: this process's place in a tensor-parallel group, and the collectives the model needs.

Megatron-style sharding needs four collectives, all on ``torch.distributed`` (gloo on CPU):

* ``all_reduce`` after each row-parallel layer (o_proj, down_proj) and after the vocab-parallel embedding:
  every rank ends with the same sum -- bitwise: gloo's ring reduces each chunk once and sends the result
  around, so no rank sums in its own order (tests/parallel/test_tensor_parallel.py checks it);
* ``gather_logits``: each rank's vocabulary slice of the LM head's logits, concatenated on rank 0;
* ``broadcast`` of each step's flat inputs from rank 0 (``pagedkv.parallel.wire``).

``exact`` trades the all-reduce for two all-gathers per row-parallel layer (:meth:`row_parallel`): the
layer's input is gathered whole and each rank computes its slice of the *outputs* over the full input, so
every output keeps the one summation order it has in one process, and TP=N gives TP=1's bits.

Two process groups: ``compute`` (the collectives inside a step) with a short timeout, so a rank that died
or hangs fails the step within ``STEP_TIMEOUT_S`` instead of hanging the engine; and ``control`` (the wait for
the next step) with a very long one, since a worker of an idle server waits for hours and that is fine.
``SINGLE`` is the group of one process: every collective is the identity, and the model code has no
``if parallel`` branches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

STEP_TIMEOUT_S = 120.0  # a collective inside one step; a first step can include a kernel build elsewhere
IDLE_TIMEOUT = timedelta(days=365)  # a worker waiting for the next step


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    compute: Any = field(default=None, compare=False)  # torch.distributed process groups (None: one process)
    control: Any = field(default=None, compare=False)
    exact: bool = False  # row-parallel layers over gathered inputs: TP=1's bits (see row_parallel)

    @property
    def is_driver(self) -> bool:
        """Rank 0: it runs the scheduler, the KV manager and the sampler, and receives the logits."""
        return self.rank == 0

    def split(self, size: int, what: str) -> int:
        """This rank's share of ``size`` (heads, intermediate rows): a size that does not divide is refused."""
        if size % self.world_size:
            raise ValueError(
                f"tensor_parallel_size {self.world_size} does not divide the model's {what} ({size}): "
                "choose a size that divides the number of query heads, KV heads and the MLP width"
            )
        return size // self.world_size

    def vocab_rows(self, vocab_size: int) -> int:
        """Vocabulary rows per rank; the last rank's slice is padded with zero rows when it does not divide."""
        return -(-vocab_size // self.world_size)

    def shard(self, tensor: Tensor, dim: int) -> Tensor:
        """This rank's equal slice of ``tensor`` along ``dim``."""
        size = tensor.shape[dim] // self.world_size
        return tensor.narrow(dim, self.rank * size, size)

    def shard_vocab(self, tensor: Tensor, vocab_size: int) -> Tensor:
        """This rank's rows of a vocabulary-sized matrix, padded with zero rows to ``vocab_rows``."""
        rows = self.vocab_rows(vocab_size)
        part = tensor[self.rank * rows : (self.rank + 1) * rows]
        if part.shape[0] == rows:
            return part
        return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.compute)
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.compute)
        return torch.cat(parts, dim=-1)

    def row_parallel(self, linear: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """The full output of a row-parallel layer (o_proj, down_proj) on every rank, from this rank's slice
        ``x`` of its input: partial sums all-reduced, or (``exact``) outputs of the gathered input gathered."""
        if self.world_size == 1:
            return linear(x)
        if self.exact:
            return self.all_gather(linear(self.all_gather(x)))
        return self.all_reduce(linear(x))

    def row_parallel_shape(self, local_in: int, out_features: int) -> tuple[int, int]:
        """``(in, out)`` of this rank's weight of a row-parallel layer whose input slice is ``local_in`` wide: that
        slice to every output, or (``exact``) the whole gathered input to this rank's slice of the outputs."""
        if self.exact:
            return local_in * self.world_size, self.split(out_features, "hidden size")
        return local_in, out_features

    def gather_logits(self, local: Tensor, vocab_size: int) -> Tensor:
        """Rank 0: the full ``[rows, vocab_size]`` logits from every rank's slice; other ranks: their slice."""
        if self.world_size == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(local, parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else local

    def broadcast(self, tensor: Tensor, idle: bool = False) -> Tensor:
        """Rank 0's ``tensor`` into every rank's (``idle``: on the long-timeout group, to wait for a step)."""
        dist.broadcast(tensor, src=0, group=self.control if idle else self.compute)
        return tensor


SINGLE = TensorParallel()


def join_group(rank: int, world_size: int, init_method: str, exact: bool = False) -> TensorParallel:
    """Join (and for the first caller, create) the gloo group; blocks until all ``world_size`` ranks have."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
    compute = dist.new_group(backend="gloo", timeout=timedelta(seconds=STEP_TIMEOUT_S))
    return TensorParallel(rank, world_size, compute, dist.group.WORLD, exact)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
