"""Prompt scoring: how likely the model found each prompt token (``SamplingParams.prompt_logprobs``).

Evaluation harnesses score a text by summing the log-probabilities of its tokens (the completions call
``echo: true, logprobs: k, max_tokens: 0``). The logits of position ``p`` give token ``p + 1`` its logprob,
so a prompt of P tokens needs the LM head on P - 1 rows -- a vocabulary-wide row each (49,152 floats for
the default model). They are turned into logprobs a slice of rows at a time, so a long prompt never holds
``rows x vocab`` floats at once, and each row is reduced to what is reported: the actual token's logprob,
its rank, and the top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pagedkv.engine.request import PromptLogprob

ROWS_PER_SLICE = 256  # 48 MB of logits at a time for a 49,152-token vocabulary


def score_rows(
    compute_logits: Callable[[Tensor], Tensor], hidden: Tensor, targets: list[int], top: int
) -> list[PromptLogprob]:
    """One entry per row of ``hidden`` (final hidden states): the logprob and rank of ``targets[i]`` (the
    token that followed), and the ``top`` most likely tokens, best first, all from the raw logits.

    Every value of a row comes from that row's logits alone (row-wise ops), so a token scores the same
    bits whatever the slice, the step or the batch it was computed in.
    """
    out: list[PromptLogprob] = []
    for first in range(0, len(targets), ROWS_PER_SLICE):
        logprobs = compute_logits(hidden[first : first + ROWS_PER_SLICE]).log_softmax(dim=-1)
        wanted = torch.tensor(targets[first : first + ROWS_PER_SLICE], dtype=torch.int64)
        actual = logprobs.gather(1, wanted.unsqueeze(1))
        ranks = (logprobs > actual).sum(dim=1).add_(1).tolist()
        values, ids = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
        for token, logprob, rank, ids_row, values_row in zip(
            wanted.tolist(), actual.squeeze(1).tolist(), ranks, ids.tolist(), values.tolist(), strict=True
        ):
            out.append(PromptLogprob(token, logprob, rank, list(zip(ids_row, values_row, strict=True))))
    return out
