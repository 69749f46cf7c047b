"""Embeddings: a prompt's final hidden states pooled into one vector (``SamplingParams.pooling``).

A decoder model has no embedding head. As vLLM pools decoder models, the embedding is read from the final
(normed) hidden states -- what the LM head would read -- either at the prompt's last token ("last": the one
position that has seen the whole prompt) or averaged over every prompt position ("mean"), then L2-normalised
so that a dot product of two embeddings is their cosine.

An embedding request is a prefill that samples nothing. "last" needs only the last prompt row, which every
prefill computes (a full prefix-cache hit still recomputes the last token), so it keeps its cache hit.
"mean" needs every row, so, like prompt scoring, its prefill starts at position 0 over its cached blocks
(their K/V is read, not written again). Rows arrive in chunks (chunked prefill; a preempted request computes
them again, to the same bits), are written by position into one tensor, and are pooled once the prompt is
done in one fixed-order reduction: the vector does not depend on how the prompt was chunked or batched.
"""

from __future__ import annotations

import torch
from torch import Tensor


def needs_every_row(pooling: str | None) -> bool:
    """Whether the pooling reads every prompt position (its prefill starts at 0 over a cache hit)."""
    return pooling == "mean"


def kept_positions(pooling: str, num_prompt_tokens: int, start: int, end: int) -> range:
    """The positions among ``[start, end)`` (one step's chunk) whose hidden states the pooling reads."""
    first = 0 if needs_every_row(pooling) else num_prompt_tokens - 1
    return range(max(start, first), min(end, num_prompt_tokens))


def keep(kept: Tensor | None, pooling: str, num_prompt_tokens: int, first_position: int, rows: Tensor) -> Tensor:
    """Write one chunk's rows into the request's kept rows (allocated at the first chunk), at their positions:
    a chunk computed again after a preemption, perhaps cut elsewhere, overwrites them with the same bits."""
    wanted = kept_positions(pooling, num_prompt_tokens, 0, num_prompt_tokens)
    if kept is None:
        kept = rows.new_empty(len(wanted), rows.shape[-1])
    offset = first_position - wanted.start
    kept[offset : offset + len(rows)] = rows
    return kept


def pool(pooling: str, kept: Tensor) -> list[float]:
    """The normalised embedding of a finished prompt from its kept rows (``[positions kept, hidden]``)."""
    vector = kept[-1] if pooling == "last" else kept.float().mean(dim=0)
    return torch.nn.functional.normalize(vector.float(), dim=0).tolist()
