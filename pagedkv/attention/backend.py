"""AttentionBackend: how every layer attends, chosen once when the engine starts and handed to the layers.

Choosing at start means a machine without a compiler runs (on the torch backend, with one log line saying
why) instead of failing at its first step, and a layer's forward is one method call with no dispatch on a
name. Both backends give the same numbers within float rounding (tests/attention/test_kernel.py holds them to it);
only the kernel is batch-invariant to the bit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from pagedkv import kernels
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import KernelAttention, TorchAttention
from pagedkv.config import ATTENTION_BACKENDS  # the compiled paged attention kernel, or gather + SDPA (torch only)

ENV_VAR = "PAGEDKV_ATTENTION_BACKEND"


class AttentionBackend(Protocol):
    name: str  # one of ATTENTION_BACKENDS

    def build_metadata(
        self, block_tables: Sequence[Sequence[int]], query_lens: Sequence[int], seq_lens: Sequence[int], block_size: int
    ) -> AttentionMetadata:
        """One step's metadata, with what this backend precomputes per step (requests in any order)."""
        ...

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> Tensor:
        """Write ``k, v [T, Hkv, D]`` at ``meta.slot_mapping``, then attend ``q [T, Hq, D]``: ``[T, Hq, D]``.
        ``window`` > 0: a query at position p attends to keys (p - window, p] only (a sliding-window layer)."""
        ...


def select_backend(requested: str | None) -> AttentionBackend:
    """The ``attention_backend`` option (one of ``ATTENTION_BACKENDS``, checked by ``EngineConfig``), else
    ``$PAGEDKV_ATTENTION_BACKEND``, else the kernel if it builds.

    Asking for the kernel where it cannot be built gives the torch backend, with a warning.
    """
    source = f"attention_backend={requested!r}"
    value = os.environ.get(ENV_VAR, "").strip()
    if requested is None and value:
        if value not in ATTENTION_BACKENDS:
            raise ValueError(f"${ENV_VAR}={value!r} is not one of {ATTENTION_BACKENDS}: use one of those, or unset it")
        requested, source = value, f"${ENV_VAR}={value}"
    wanted = None if requested is None else requested == "kernel"
    return KernelAttention() if kernels.use_compiled(wanted, source, kernels.portable) else TorchAttention()
