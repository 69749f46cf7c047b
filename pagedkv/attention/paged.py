"""Paged attention: write the step's K/V into the pool, then attend through the block tables.

One call per layer handles a whole mixed step. Decodes (the first ``meta.num_decodes`` requests, one query
each) run batched: one gather of all their contexts and one SDPA, or the compiled kernel when the backend
is ``"kernel"``. Prefill chunks -- whose context may already hold earlier chunks or prefix-cache hits --
share one gather of all their contexts, then one SDPA each, on ``permute`` views of the gathered rows
(making them contiguous first was measured 4x slower).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from pagedkv.attention.metadata import AttentionMetadata, decode_gather_index
from pagedkv.kv import ops


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "gather",
) -> Tensor:
    """Attention of the step's queries ``q [T, Hq, D]`` over their requests' contexts; returns ``[T, Hq, D]``.

    ``k, v [T, Hkv, D]`` are the step's new keys and values; they are written at ``meta.slot_mapping``
    first, so every query sees its own token. Query heads share KV heads in groups of ``Hq // Hkv``.
    """
    ops.write_kv(k_pool, meta.slot_mapping, k)
    ops.write_kv(v_pool, meta.slot_mapping, v)
    out = q.new_empty(q.shape)
    n = meta.num_decodes
    if n:
        if backend == "kernel":
            from pagedkv.attention.backend import decode_attention

            out[:n] = decode_attention(backend, q[:n], k_pool, v_pool, meta.block_tables[:n], meta.seq_lens[:n], scale)
        else:
            out[:n] = decode_attention_gather(
                q[:n],
                k_pool,
                v_pool,
                meta.block_tables[:n],
                meta.seq_lens[:n],
                scale,
                index=meta.decode_gather_index(),
            )
    if n < meta.num_requests:
        _prefill_attention(q, k_pool, v_pool, meta, scale, out)
    return out


def decode_attention_gather(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    index: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """One query per request, ``q [B, Hq, D]``, over positions ``[0, seq_len)``: ``[B, Hq, D]``.

    All contexts come out of the pool in one ``index_select`` per pool, padded to the longest and masked.
    The ``Hq // Hkv`` query heads of a KV head become SDPA's query length, so GQA needs no copied K/V.
    ``index`` is :func:`decode_gather_index` precomputed for the step (it is the same for every layer).
    """
    batch, q_heads, dim = q.shape
    kv_heads = k_pool.shape[2]
    slots, mask = index if index is not None else decode_gather_index(block_tables, seq_lens, k_pool.shape[1])
    length = mask.shape[-1]
    k = ops.gather_slots(k_pool, slots).view(batch, length, kv_heads, dim).permute(0, 2, 1, 3)
    v = ops.gather_slots(v_pool, slots).view(batch, length, kv_heads, dim).permute(0, 2, 1, 3)
    query = q.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
    return out.view(batch, q_heads, dim)


def _prefill_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, meta: AttentionMetadata, scale: float, out: Tensor
) -> None:
    """Causal attention of each prefill chunk over its whole context (earlier chunks and prefix hits too).

    SDPA gets 4-D ``[1, H, L, D]`` views: with 3-D inputs it was measured to fall back to a 3-10x slower path.
    """
    k_all = ops.gather_slots(k_pool, meta.prefill_kv_slots)
    v_all = ops.gather_slots(v_pool, meta.prefill_kv_slots)
    qsl = meta.query_start_loc_list
    kv_start = 0
    for i, mask in enumerate(meta.prefill_masks, start=meta.num_decodes):
        q_start, q_end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens_list[i]
        kv_end = kv_start + seq_len
        attn = F.scaled_dot_product_attention(
            q[q_start:q_end].permute(1, 0, 2).unsqueeze(0),
            k_all[kv_start:kv_end].permute(1, 0, 2).unsqueeze(0),
            v_all[kv_start:kv_end].permute(1, 0, 2).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[q_start:q_end] = attn[0].permute(1, 0, 2)
        kv_start = kv_end
