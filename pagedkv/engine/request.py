"""Request (one sequence the engine is generating) and RequestOutput (what callers get back)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.kv.hashing import BlockKey, extend_block_keys
from pagedkv.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's RequestOutputKind).

    CUMULATIVE: everything so far, every step (simple, but copying the whole output each step is O(L^2)).
    DELTA: only what is new since the previous output (a stream forwards it as is).
    FINAL_ONLY: one output, when the request finishes (offline batch generation needs nothing else).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


# The message a caller sees when its request failed inside the engine: the details go to the log only,
# since an exception's text may carry another request's data or the server's internals.
INTERNAL_ERROR = "the engine failed while processing this request; it was stopped and its resources freed"


@dataclass(slots=True)
class Request:
    """One sequence as the engine core sees it: tokens, progress, blocks. A request with ``n > 1`` becomes n
    of these that share a ``group_id``. Text, streaming cursors and logprobs live in the output processor.

    ``token_ids`` is prompt + output in one list, appended to in place, so neither the scheduler nor the
    runner ever concatenates. ``block_keys`` holds the prefix-cache key of every full block of ``token_ids``
    (``block_size`` 0: prefix caching is off and nothing is hashed), extended by ``append_tokens``.
    """

    request_id: str
    group_id: str
    index: int  # which of the group's n samples this is
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    block_size: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    cache_miss_reason: str | None = None  # why that hit ended where it did (pagedkv.kv.cache_report)
    # The first uncached block's index when the request was first held back for another request computing it.
    waited_for_block: int | None = None
    # The current admission's prefix-cache hit: K/V of positions below it lie in shared blocks and are never
    # written again (a request scoring its prompt still runs those positions, for their logits).
    num_hit_tokens: int = 0
    prompt_scored: bool = False  # prompt_logprobs computed (they are not computed again after a preemption)
    # The group's first sample, when it scores the prompt: the other samples start once it has, so every
    # sample's first output comes with the prompt logprobs (and they hit its blocks in the cache).
    scorer: Request | None = None
    # with SamplingParams.pooling: the final hidden states of the prompt positions it pools, [positions, hidden]
    # (pagedkv.engine.pooling), filled chunk by chunk
    pooled_rows: torch.Tensor | None = None
    grammar: Any = None  # an llguidance matcher with structured_outputs (pagedkv.structured), else None
    block_keys: list[BlockKey] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    stopped_on_token: bool = False  # its last token was EOS or a stop id (not part of the text)

    def __post_init__(self) -> None:
        self._key_full_blocks()

    def append_tokens(self, token_ids: list[int]) -> None:
        """Append sampled (verified) tokens, key the blocks they complete, and advance the grammar."""
        self.token_ids.extend(token_ids)
        self._key_full_blocks()
        if self.grammar is not None and not self.grammar.consume_tokens(token_ids):
            raise RuntimeError(f"the grammar refused a sampled token: {self.grammar.get_error()}")

    def _key_full_blocks(self) -> None:
        if self.block_size and len(self.token_ids) // self.block_size > len(self.block_keys):
            extend_block_keys(self.block_keys, self.token_ids, self.block_size, self.cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def event_token_ids(self) -> list[int]:
        """The token ids KV events may publish with this request's blocks: none with a cache_salt -- a tenant
        that asked for its own cache keeps its prompt to itself; the block hashes still let a router route."""
        return [] if self.cache_salt is not None else self.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether this prefill computes prompt logprobs: asked for, not done yet, and the group's first
        sample only (the n samples share one prompt)."""
        return self.params.prompt_logprobs is not None and self.index == 0 and not self.prompt_scored


@dataclass(slots=True)
class PromptLogprob:
    """How likely the model found one prompt token, given the tokens before it (vLLM's prompt_logprobs):
    its logprob, its rank among the vocabulary (1 = the most likely), and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]


@dataclass(slots=True)
class CoreOutput:
    """What one step did for one request, as the scheduler reports it to the output processor: a snapshot,
    so the processor never reads core state (it may run on another thread)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    stop_token: bool = False  # the last new token ended the request as EOS or a stop id: not part of the text
    cache_miss_reason: str | None = None
    logprobs: list[float] | None = None  # one per new token, for requests that asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # prompt logprobs computed this step: (position of the first one, one entry per position from there)
    prompt_logprobs: tuple[int, list[PromptLogprob]] | None = None
    embedding: list[float] | None = None  # with SamplingParams.pooling, once the prompt is done

    @classmethod
    def of(cls, request: Request, new_token_ids: list[int]) -> CoreOutput:
        return cls(
            request.request_id,
            new_token_ids,
            request.finish_reason,
            request.stop_reason,
            request.num_cached_tokens or 0,
            request.stopped_on_token,
            request.cache_miss_reason,
        )


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples: text/tokens (cumulative, or only the new part with OutputKind.DELTA)
    plus what is new since the last report. finish_reason "error": the engine failed this sample alone."""

    index: int
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request (all its samples). ``text`` / ``token_ids`` read the first sample.

    ``error``: set when a sample finished with "error"; a message safe to show the client.
    ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, one entry per prompt token, None for the
    first (nothing precedes it), in every output from the one where the whole prompt is scored.
    ``num_cached_tokens``: prompt tokens reused from the prefix cache; ``cache_miss_reason``: why not more
    (``hit``, ``new``, ``evicted``, ``last_token``, ``waited`` or ``disabled``; see pagedkv.kv.cache_report).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
    cache_miss_reason: str | None = None
    embedding: list[float] | None = None  # with SamplingParams.pooling: the pooled, normalised prompt

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
