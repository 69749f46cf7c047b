"""SamplingParams: how one request picks its tokens and when it stops, validated once at creation.

Field names, defaults and meanings follow vLLM's SamplingParams so that code written against vLLM reads the
same here. Validation happens in `__post_init__`, so a bad value fails where the user wrote it, not deep
inside a batched engine step; every message names the field and the range it accepts. The batched sampler
that consumes these lives in `pagedkv.sampler`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf/nan, and the
# distribution is a point mass on the argmax for all practical purposes anyway (vLLM uses the same cut).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """Raise unless lo <= value <= hi (lo < value if lo_open); NaN fails every comparison, so it fails too."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        left = "(" if lo_open else "["
        right = "inf)" if math.isinf(hi) else f"{hi}]"
        raise ValueError(f"{name} must be in {left}{lo}, {right}, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping settings.

    n: completions per prompt. max_tokens: output-token budget (None = until max_model_len).
    min_tokens: EOS and stop_token_ids are masked out until this many tokens exist (stop strings are not
    checked before then either). temperature: 0 (anything below SAMPLING_EPS) means greedy.
    top_p in (0, 1], top_k (0 or -1 = disabled; -1 is stored as 0), min_p in [0, 1]: applied in that order
    after temperature. seed: a per-request generator, so the request draws the same tokens whatever else
    shares its batch. presence/frequency_penalty in [-2, 2] act on output tokens; repetition_penalty > 0
    (1 = off) acts on prompt and output tokens. stop: strings that end the output (a single str becomes a
    one-element list); stop_token_ids: extra ids that end it. logprobs: return the sampled token's logprob
    plus the top-N (0..20) alternatives, all from the raw model logits.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stops()
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}] (0 = only the sampled token), "
                f"got {self.logprobs!r}"
            )
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64) (torch's), got {self.seed!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _validate_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(
                f"max_tokens must be an int >= 1 (or None to generate until max_model_len), got {self.max_tokens!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}; "
                "raise max_tokens or lower min_tokens"
            )

    def _validate_distribution(self) -> None:
        _check_range("temperature", self.temperature, 0.0, math.inf)
        if math.isinf(self.temperature):
            raise ValueError(f"temperature must be finite (0 = greedy), got {self.temperature!r}")
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int: -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        _check_range("min_p", self.min_p, 0.0, 1.0)

    def _validate_penalties(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True)
        if math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be finite and > 0 (1 = off), got {self.repetition_penalty!r}")

    def _validate_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {s!r} in it")
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {t!r} in it")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of presence / frequency / repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
