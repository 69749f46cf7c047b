"""SamplingParams: how one request picks its tokens and when it stops, validated once at creation.

Field names, defaults and meanings follow vLLM's SamplingParams so that code written against vLLM reads the
same here. Validation happens in `__post_init__`, so a bad value fails where the user wrote it, not deep
inside a batched engine step; every message names the field and the range it accepts. The bounds hold in the
precision the sampler computes in (float32), not just in Python's float64: `top_p=1e-50` is a valid float64
but 0 in float32. The batched sampler that consumes these lives in `pagedkv.sampler`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedkv.errors import InvalidParameter
from pagedkv.structured import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf/nan, and the
# distribution is a point mass on the argmax for all practical purposes anyway (vLLM uses the same cut).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
# logits / T must stay finite and mean something in float32. Model logits are at most a few dozen, so at
# T = 100 every token is already within a factor ~2 of uniform; and from 3.4e38 on float32(T) is inf,
# where a masked -inf logit divided by T is NaN, which unmasks it.
TEMPERATURE_MAX = 100.0
# The nucleus always holds the most likely token, whose probability is at least 1/V; for any vocabulary
# under a million tokens a smaller top_p keeps that token alone (use temperature=0 or top_k=1 to say so).
# Far below this top_p rounds to 0 in float32 and no token would qualify.
TOP_P_MIN = 1e-6
# min_p is applied as the logit threshold max + log(min_p) in float32: a non-zero min_p below the smallest
# normal float32 would silently become 0 there (filter off) or a denormal, so it is rejected, not rounded.
MIN_P_MIN = 2.0**-126
# Repetition divides positive and multiplies negative logits by the penalty: 1e-50 is 0 in float32 (x / 0
# is inf, -inf * 0 is NaN). Within [0.01, 100] a logit moves by at most 100x and stays finite for any
# sane model; useful values are 1-2 (1 = off).
REPETITION_PENALTY_MIN = 0.01
REPETITION_PENALTY_MAX = 100.0
# Token ids become int64 tensor indices.
TOKEN_ID_LIMIT = 2**63


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: float, lo: float, hi: float, *, hint: str = "") -> None:
    """Raise unless lo <= value <= hi; NaN fails every comparison, so it fails too. hint ends the message."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidParameter(name, f"{name} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidParameter(name, f"{name} must be in [{lo}, {hi}], got {value!r}" + (f" ({hint})" if hint else ""))


POOLING_METHODS = ("last", "mean")  # see pagedkv.engine.pooling


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping settings.

    n: completions per prompt. max_tokens: output-token budget (None = until max_model_len; 0 = only score
    the prompt, with prompt_logprobs).
    min_tokens: EOS and stop_token_ids are masked out until this many tokens exist (stop strings are not
    checked before then either). temperature in [0, 100]: 0 (anything below SAMPLING_EPS) means greedy.
    top_p in [1e-6, 1], top_k (0 or -1 = disabled; -1 is stored as 0), min_p 0 or in [2**-126, 1]: applied
    in that order after temperature. seed: a per-request generator, so the request draws the same tokens
    whatever else shares its batch. presence/frequency_penalty in [-2, 2] act on output tokens;
    repetition_penalty in [0.01, 100] (1 = off) acts on prompt and output tokens. stop: strings that end
    the output (a single str becomes a one-element list); stop_token_ids: extra ids that end it (also kept
    as stop_token_id_set). logprobs: return the sampled token's logprob plus the top-N (0..20)
    alternatives, all from the raw model logits. prompt_logprobs: the same for every prompt token after the
    first (vLLM's name): the log-probability the model gave it, its rank, and the top-N (0..20).
    structured_outputs: a grammar the output must follow (`pagedkv.structured.StructuredOutputsParams`, or
    a dict of its fields); the logprobs of such a request are those of the constrained distribution.
    pooling: "last" or "mean" makes the request an embedding (`pagedkv.engine.pooling`): its prompt's final
    hidden states pooled into one L2-normalised vector, nothing sampled (max_tokens must be 0, n 1).

    Every value these checks accept is safe for the sampler in float32 (see the bounds above); whether
    min_tokens leaves any token to sample depends on the model, so `verify_for_model` checks that.
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
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    pooling: str | None = None
    # Derived from stop_token_ids at creation: the engine asks "is this token a stop id?" every step, and a
    # list makes that O(len) for a request that sends a long one.
    stop_token_id_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stops()
        for name, what in (("logprobs", "the sampled token"), ("prompt_logprobs", "the prompt's own tokens")):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise InvalidParameter(
                    name, f"{name} must be None or an int in [0, {MAX_LOGPROBS}] (0 = only {what}), got {value!r}"
                )
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise InvalidParameter(
                "seed", f"seed must be None or an int in [-2**63, 2**64) (torch's), got {self.seed!r}"
            )
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameter(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        self._validate_pooling()

    def _validate_pooling(self) -> None:
        """An embedding samples nothing, so every setting about sampled tokens would be silently unused."""
        if self.pooling is None:
            return
        if self.pooling not in POOLING_METHODS:
            raise InvalidParameter("pooling", f"pooling must be None or one of {POOLING_METHODS}, got {self.pooling!r}")
        if self.max_tokens != 0 or self.n != 1:
            raise InvalidParameter(
                "pooling",
                f"an embedding (pooling) samples nothing: set max_tokens=0 and n=1, got {self.max_tokens} and {self.n}",
            )
        if self.prompt_logprobs is not None or self.structured_outputs is not None:
            raise InvalidParameter("pooling", "pooling cannot be combined with prompt_logprobs or structured_outputs")

    def _validate_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise InvalidParameter("n", f"n must be an int >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise InvalidParameter(
                "max_tokens",
                f"max_tokens must be an int >= 0 (0: score the prompt only; None: generate until max_model_len), "
                f"got {self.max_tokens!r}",
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidParameter("min_tokens", f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}; "
                "raise max_tokens or lower min_tokens",
            )

    def _validate_distribution(self) -> None:
        _check_range("temperature", self.temperature, 0.0, TEMPERATURE_MAX, hint="0 = greedy")
        _check_range(
            "top_p",
            self.top_p,
            TOP_P_MIN,
            1.0,
            hint=f"below {TOP_P_MIN} the nucleus is the most likely token alone: use temperature=0 or top_k=1",
        )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidParameter("top_k", f"top_k must be an int: -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if 0.0 < self.min_p < MIN_P_MIN:
            raise InvalidParameter(
                "min_p",
                f"min_p must be 0 or in [{MIN_P_MIN}, 1.0] (a normal float32; smaller is 0 to the sampler), "
                f"got {self.min_p!r}",
            )

    def _validate_penalties(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        rep = self.repetition_penalty
        _check_range("repetition_penalty", rep, REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX, hint="1 = off")

    def _validate_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameter(
                    "stop", f"stop must be a non-empty string or a list of non-empty strings, got {s!r} in it"
                )
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t < TOKEN_ID_LIMIT:
                raise InvalidParameter(
                    "stop_token_ids", f"stop_token_ids must hold ints in [0, 2**63) (int64 token ids), got {t!r} in it"
                )
        self.stop_token_id_set = frozenset(self.stop_token_ids)

    def verify_for_model(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """Raise ValueError when min_tokens would leave this model no token to sample.

        Below min_tokens the sampler masks stop_token_ids and EOS (unless ignore_eos); only the model knows
        its vocabulary and EOS ids, so the engine calls this once when it accepts the request, not per step.
        """
        if self.min_tokens == 0:
            return
        masked = self.stop_token_id_set if self.ignore_eos else self.stop_token_id_set.union(eos_token_ids)
        if len(masked) >= vocab_size and sum(1 for t in masked if 0 <= t < vocab_size) == vocab_size:
            eos = "" if self.ignore_eos else " (with EOS)"
            raise InvalidParameter(
                "stop_token_ids",
                f"stop_token_ids must leave one of the model's {vocab_size} token ids to sample while min_tokens "
                f"({self.min_tokens}) is > 0, but{eos} they cover all of them; remove some stop_token_ids"
                + ("" if self.ignore_eos else ", set ignore_eos=True")
                + " or set min_tokens=0",
            )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of presence / frequency / repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def is_plain_greedy(self, num_output_tokens: int) -> bool:
        """True when the next token is the argmax of the raw logits and nothing more is reported for it:
        greedy, no penalties, no logprobs, and min_tokens reached (below it EOS and stop ids are masked)."""
        return self.greedy and self.logprobs is None and not self.has_penalties and self.min_tokens <= num_output_tokens
