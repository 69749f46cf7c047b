"""The two attention backends a layer calls (:data:`AttentionBackend`), and the choice between them.

Both backends write the step's K/V into the pool, then attend through the block tables.

:class:`KernelAttention` (``"kernel"``) sends every row of the step -- decodes and prefill chunks -- to the
compiled kernel in one call; it reads K/V where they lie and is batch-invariant: a row's output is the same
bits whatever else the step holds, however its prompt was chunked, and on any thread count.
:class:`TorchAttention` (``"gather"``) copies every request's context out of the pool with one
``index_select`` per pool, then runs SDPA per request on views of that copy: torch only, the fallback where
the kernel cannot be built, and the same numbers within float rounding (not bitwise, and not batch-invariant).

The torch backend's decode path was picked by measurement (AMD EPYC Zen 4, 2 threads, SmolLM2's 3/9 x 64
heads): per-request SDPA against one padded, masked SDPA over the batch. Per layer, per request was up to
37x faster with mixed context lengths (32 decodes of 100 tokens and one of 4,000: 2.2 vs 82 ms; 32 of
16-2,048 tokens: 11 vs 44 ms) and 1.1-2x slower with equal ones (32 x 128: 1.4 vs 0.7 ms). End to end, 16
prompts of 40-2,000 tokens ran in 18 s instead of 23-45 s, and the 32 near-equal chats of
``benchmarks/throughput.py`` in 13-15.6 s instead of 9.4 s. The padded loss grows with the spread of the
lengths, which continuous batching makes wide, so per request it is, and decodes share the prefill loop.

The backend is chosen once, when the engine starts (:func:`select_backend`), and handed to the layers: a
machine without a compiler then runs (on the torch backend, with one log line saying why) instead of failing
at its first step, and a layer's forward is one method call with no dispatch on a name.
"""

from __future__ import annotations

import os

import torch.nn.functional as F
from torch import Tensor

from pagedkv import kernel_ops, kernels
from pagedkv.attention.metadata import AttentionMetadata, GatherMetadata
from pagedkv.config import ATTENTION_BACKENDS  # the compiled paged attention kernel, or gather + SDPA (torch only)
from pagedkv.kv import ops

ENV_VAR = "PAGEDKV_ATTENTION_BACKEND"


class TorchAttention:
    """Gather + SDPA for every request: runs wherever torch does. Not batch-invariant: SDPA picks its
    algorithm and blocking from the shapes, so a row's last bits depend on how its prompt was chunked (one
    prefill chunk or one decode at a time measured 1e-6 apart), and may depend on the thread count."""

    name = "gather"
    # The step's metadata, with the contexts to gather (the same for every layer, so built once a step).
    build_metadata = GatherMetadata.build

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        meta: GatherMetadata,
        scale: float,
        window: int = 0,
    ) -> Tensor:
        """Attention of the step's queries ``q [T, Hq, D]`` over their requests' contexts; returns ``[T, Hq, D]``.

        ``k, v [T, Hkv, D]`` are the step's new keys and values; they are written at ``meta.slot_mapping``
        first, so every query sees its own token. Query heads share KV heads in groups of ``Hq // Hkv``.

        Each request attends over its whole context (earlier chunks and prefix hits too). One ``index_select``
        per pool copies all those contexts; SDPA then gets 4-D ``[1, H, L, D]`` ``permute`` views of it: with
        3-D inputs it was measured to fall back to a 3-10x slower path, and making the views contiguous first
        was 4x slower. ``enable_gqa`` lets the query heads share KV heads without a copy.

        ``window`` > 0 (a sliding-window layer): a query at position p sees keys (p - window, p] only; SDPA gets
        just the keys some query of the request can see (at most ``window - 1 + query_len``), so a windowed
        layer's cost stays bounded however long the context grows.
        """
        ops.write_kv(k_pool, meta.slot_mapping, k)
        ops.write_kv(v_pool, meta.slot_mapping, v)
        k_all = ops.gather_slots(k_pool, meta.context_slots).to(q.dtype)  # an fp16 pool's values, widened exactly
        v_all = ops.gather_slots(v_pool, meta.context_slots).to(q.dtype)
        out = q.new_empty(q.shape)
        qsl = meta.query_start_list
        kv_start = 0
        views = meta.window_views(window) if window else None
        for i, mask in enumerate(meta.context_masks):
            q_start, q_end = qsl[i], qsl[i + 1]
            kv_end = kv_start + meta.seq_lens_list[i]
            first = kv_start
            if views is not None:
                skipped, mask = views[i]
                first += skipped
            attn = F.scaled_dot_product_attention(
                q[q_start:q_end].permute(1, 0, 2).unsqueeze(0),
                k_all[first:kv_end].permute(1, 0, 2).unsqueeze(0),
                v_all[first:kv_end].permute(1, 0, 2).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None and q_end - q_start > 1,
                scale=scale,
                enable_gqa=True,
            )
            out[q_start:q_end] = attn[0].permute(1, 0, 2)
            kv_start = kv_end
        return out


class KernelAttention:
    """Every row on the compiled kernel in one call: no K/V copy, batch-invariant (see the module docstring)."""

    name = "kernel"
    # The step's metadata: the kernel needs only slots, block tables, lengths and row offsets.
    build_metadata = AttentionMetadata.build

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
        """As :meth:`TorchAttention.forward`; both pools written in one compiled call."""
        kernel_ops.write_kv(k_pool, v_pool, meta.slot_mapping, k, v)
        return kernel_ops.paged_attention(
            q, k_pool, v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window
        )


# What every layer attends through: ``build_metadata`` once a step, then ``forward`` per layer (the two methods
# and ``name``, one of ATTENTION_BACKENDS, are all a layer uses).
AttentionBackend = KernelAttention | TorchAttention


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
