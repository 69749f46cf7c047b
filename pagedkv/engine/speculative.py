"""Prompt-lookup (n-gram) speculative decoding: guess a request's next tokens from its own history.

Answers often repeat what the prompt says ("The library opens from ten to four on Saturdays"). When the
last few tokens of a request also occur earlier in its prompt or output, the tokens that followed them
there are a cheap guess -- a "draft" -- for what comes next (vLLM's ``ngram`` method, llama.cpp's lookup
decoding). The engine then runs the last token and the drafts in one step, as a few extra rows of the
batch, and keeps every draft token the model itself would have chosen, plus the model's own next token.
Greedy output is unchanged; a step just yields up to ``1 + k`` tokens instead of one.

On a CPU a decode step of a few requests is bound by reading the weights, not by arithmetic, so the extra
rows are nearly free there -- but a large batch is already compute bound and drafts would only add work.
Hence drafts are made only while the step stays small (``MAX_ROWS``), shortest first when it is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagedkv.engine.request import Request

MAX_NGRAM = 4  # longest history suffix looked up
MIN_NGRAM = 2  # a single repeated token ("the", ",") predicts too little to pay for its rows
MAX_ROWS = 48  # decode rows (last tokens + drafts) per step up to which drafting paid off on 2 AVX2 cores


def draft_length(running: Sequence[Request], num_speculative_tokens: int) -> int:
    """Drafts per decoding request this step: all of ``num_speculative_tokens`` while the step's decode
    rows stay within ``MAX_ROWS``, fewer as the batch grows, none for a large batch."""
    if not num_speculative_tokens:
        return 0
    decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
    return max(0, min(num_speculative_tokens, MAX_ROWS // max(decoding, 1) - 1))


def drafts_for(request: Request, limit: int, max_model_len: int) -> list[int]:
    """Drafts for a decoding request: within ``limit``, its max_tokens (the model's own token after the
    drafts comes too) and the model's context length.

    Drafts are checked by greedy choice, so only plain greedy requests take them: sampling, penalties,
    logprobs and a pending ``min_tokens`` change what the next token would be or what must be reported
    for it; those requests decode one token a step.
    """
    if limit < 1 or not request.params.is_plain_greedy(request.num_output_tokens):
        return []
    max_tokens = request.params.max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - request.num_output_tokens - 1)
    limit = min(limit, max_model_len - request.num_tokens - 1)
    drafts = propose(request.token_ids, limit)
    if drafts and request.grammar is not None:  # a draft the grammar refuses could never be accepted
        drafts = drafts[: request.grammar.validate_tokens(drafts)]
    return drafts


def propose(token_ids: list[int], num_tokens: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the history's last n-gram.

    The longest n-gram (``MAX_NGRAM`` down to ``MIN_NGRAM``) with an earlier occurrence wins; [] if none.
    """
    if num_tokens < 1 or len(token_ids) <= MIN_NGRAM:
        return []
    history = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(MAX_NGRAM, len(history) - 1), MIN_NGRAM - 1, -1):
        # windows[i] = history[i : i + n] for every start i whose window ends before the last token
        windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)
        starts = np.flatnonzero((windows == history[-n:]).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return history[follow : follow + num_tokens].tolist()
    return []


def accepted_length(drafts: list[int], chosen: list[int]) -> int:
    """How many drafts the model agreed with: ``chosen[i]`` is its token after the i-th row (row 0 is the
    last real token), so draft i stands while ``chosen[i] == drafts[i]`` held for it and all before it."""
    accepted = 0
    while accepted < len(drafts) and chosen[accepted] == drafts[accepted]:
        accepted += 1
    return accepted
