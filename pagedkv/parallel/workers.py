"""Starting and stopping tensor-parallel ranks: rank 0 is the engine, ranks 1..N-1 are workers.

A worker joins the group, then runs the ``serve`` it was given (the engine's, in engine/builder.py: load
its shard, run the steps rank 0 broadcasts until rank 0 says stop): this module starts, watches and stops the
ranks, and never builds a model. The same code runs whether the ranks share a machine or not.

Two ways to get the ranks:

* one machine (``tensor_parallel_size=N``): rank 0 spawns N-1 processes (``torch.multiprocessing``,
  spawn) and they meet on a TCP port on 127.0.0.1 that the OS picked free at start;
* several machines: every rank is started by ``torchrun`` (``env://``: ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``); ranks other than 0 serve as workers and exit when rank 0 is done.

A worker that dies is noticed before the next step (its exit code, one machine) or by the step's
collectives failing within ``STEP_TIMEOUT_S`` (any machine): the step raises
:class:`TensorParallelFailure`, which stops the engine with a clear error instead of hanging it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from pagedkv.parallel import wire
from pagedkv.parallel.group import TensorParallel, join_group, leave_group

if TYPE_CHECKING:
    from pagedkv.config import EngineConfig

logger = logging.getLogger(__name__)
Serve = Callable[[TensorParallel, "EngineConfig", str], None]  # a worker's life, from joining to rank 0's stop
STOP_WAIT_S = 10.0


class TensorParallelFailure(RuntimeError):
    """The group broke (a rank died or a collective timed out): the engine cannot run another step."""


class Workers:
    """Rank 0's handle on the other ranks: health checks before a step, and the stop at the end."""

    def __init__(self, tp: TensorParallel, processes: list) -> None:
        self.tp = tp
        self.processes = processes  # empty when torchrun started the ranks
        self.closed = False

    def check(self) -> None:
        dead = [(p.name, p.exitcode) for p in self.processes if p.exitcode is not None]
        if dead:
            raise TensorParallelFailure(f"tensor-parallel worker(s) exited: {dead} (name, exit code)")

    def failure(self, exc: BaseException) -> TensorParallelFailure:
        exits = [(p.name, p.exitcode) for p in self.processes]
        return TensorParallelFailure(f"the tensor-parallel group failed ({exc}); workers (name, exit code): {exits}")

    def close(self) -> None:
        """Tell the workers to stop, wait for them, and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        # A broken group (a worker gone, or the stop not sent) leaves the others waiting on a broadcast that
        # never comes: they are killed at once rather than after STOP_WAIT_S each.
        broken = any(p.exitcode is not None for p in self.processes)
        try:
            if not broken:
                wire.send_stop(self.tp)
        except RuntimeError:
            logger.warning("could not tell the tensor-parallel workers to stop; terminating them")
            broken = True
        for process in self.processes:
            process.join(0 if broken else STOP_WAIT_S)
            if process.exitcode is None:
                process.kill()
                process.join()
        leave_group()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def start(config: EngineConfig, model_path: str, serve: Serve) -> Workers:
    """Rank 0's side: the group of ``config.tensor_parallel_size`` ranks, workers started or joined, each
    running ``serve`` (a worker's life, which the engine defines in engine/builder.py).

    Under torchrun this process may be another rank: then it serves as a worker and exits when rank 0 stops.
    """
    world = config.tensor_parallel_size
    if launched_by_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if size != world:
            raise ValueError(f"torchrun started {size} ranks but tensor_parallel_size is {world}: make them equal")
        tp = join_group(rank, size, "env://", config.tensor_parallel_exact)
        if rank != 0:
            serve(tp, config, model_path)
            raise SystemExit(0)
        return Workers(tp, [])
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    worker_config = replace(config, num_threads=rank_threads(config))
    processes = [
        context.Process(
            target=_worker_main,
            args=(rank, world, init_method, worker_config, model_path, serve),
            name=f"pagedkv-tp{rank}",
            daemon=True,
        )
        for rank in range(1, world)
    ]
    for process in processes:
        process.start()
    return Workers(join_group(0, world, init_method, config.tensor_parallel_exact), processes)


def rank_threads(config: EngineConfig) -> int:
    """Torch threads per rank: the ranks share the machine's cores unless ``num_threads`` says otherwise."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def _worker_main(rank: int, world: int, init_method: str, config: EngineConfig, model_path: str, serve: Serve) -> None:
    torch.set_num_threads(config.num_threads)
    tp = join_group(rank, world, init_method, config.tensor_parallel_exact)
    try:
        serve(tp, config, model_path)
    finally:
        leave_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
