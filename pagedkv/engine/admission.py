"""Fair seats and fair steps (issue 25 rows 5 and 6): the scheduler's policy for who gets a running seat and
how many prompt tokens a step may compute. Pure decisions over the running and waiting requests; the
Scheduler applies them (allocates blocks, preempts, admits).

Seats are shared between requests, not samples: waiting requests are admitted the one holding the fewest
seats first, and a request's n samples hold at most ``max_seqs_per_group`` seats while a request holding
fewer waits -- seats past that share are preempted for it.

Decode-first, as vLLM's chunked prefill: while any request decodes, prompts share a smaller budget
(``max_prefill_tokens_with_decodes``), so a long prompt is cut into short chunks over several steps and no
stream waits long for its next token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pagedkv.engine.request import Request

# A prompt row scored for prompt_logprobs costs this many plain rows of a step's prefill budget: its
# logits over the whole vocabulary, their log-softmax, rank and top-k come on top of the layers (default
# model, 8 requests decoding: a chunk of 32 scored rows 99 ms, plain 60 ms; of 64, 151 ms and 95 ms).
SCORED_ROW_COST = 2

# While requests decode, a prompt row also costs one more plain row per CONTEXT_TOKENS_PER_ROW tokens of the
# prompt before its chunk (counted in whole CONTEXT_STEPs), since a chunk's attention reads all of them. The
# default model, one thread, 4 requests decoding, CPU time of a step with a 64-token chunk: 0.17 s at the
# start of a prompt, 0.32 s 1,800 tokens in, 0.48 s at 4,000, 0.64 s at 6,700 (a 32-token chunk: 0.11, 0.19,
# 0.33, 0.43 s) -- past ~3,000 tokens a 64-token chunk alone broke issue 25's 0.5 s target. Weighed, the
# chunk shrinks to 34 tokens at 2,000, 26 at 3,000, 21 at 4,000, 13 at 8,000, and a step stays ~0.2-0.37 s.
CONTEXT_TOKENS_PER_ROW = 2048
CONTEXT_STEP = 256


@dataclass(slots=True)
class PrefillBudget:
    """What prompt chunks may still take from one step: ``left``, in plain rows at the start of a prompt."""

    left: int
    weigh_context: bool  # requests decode: a row's cost grows with the context before its chunk
    cap: int | None = None  # the most one prompt may take: prompts share a step while requests decode

    def _row_cost(self, request: Request, start: int) -> int:
        """A prompt row's cost from position ``start`` on, in 1/CONTEXT_TOKENS_PER_ROW plain rows."""
        context = start // CONTEXT_STEP * CONTEXT_STEP if self.weigh_context else 0
        return (CONTEXT_TOKENS_PER_ROW + context) * (SCORED_ROW_COST if request.scores_prompt else 1)

    def chunk(self, request: Request, start: int) -> int:
        """The most prompt tokens of ``request`` from position ``start`` whose cost fits in what is left (at
        least one while anything is left, so a prompt progresses under any budget)."""
        left = self.left if self.cap is None else min(self.left, self.cap)
        if left <= 0:
            return 0
        return max(left * CONTEXT_TOKENS_PER_ROW // self._row_cost(request, start), 1)

    def spend(self, request: Request, start: int, num_new: int) -> None:
        """Take a chunk of ``num_new`` prompt tokens from position ``start`` (rounded up to whole rows)."""
        self.left -= -(-num_new * self._row_cost(request, start) // CONTEXT_TOKENS_PER_ROW)


@dataclass(slots=True)
class FairShare:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_seqs_per_group: int  # seats one request's n samples hold while others wait
    max_prefill_tokens_with_decodes: int

    def prefill_budget(self, running: list[Request], admissible: bool = False) -> PrefillBudget:
        """Prompt tokens this step may compute (scored rows weigh more, see ``SCORED_ROW_COST``, and while
        requests decode, rows far into a prompt do too, see ``CONTEXT_TOKENS_PER_ROW``).

        Decode-first, as vLLM's chunked prefill: the decoding requests' rows are set aside, and while any
        request decodes, prompts get at most ``max_prefill_tokens_with_decodes``, since every stream waits for
        the whole step. The default model, 8 requests decoding, CPU time of a step on one thread: decodes
        alone 31 ms; with a chunk of 64 prompt tokens 0.20 s, 128: 0.39 s, 256: 0.79 s (~3 ms a token from 64
        up, so small chunks cost a long prompt no throughput), and a chunk's attention adds ~30 % per 1,000
        tokens of context before it (128 tokens: 0.39 s at the start of a prompt, 0.55 s at 1,400). The
        default, 64, with rows weighed by their context, keeps a step at 0.19-0.25 s on one core from a
        prompt's start to 7,000 tokens in (on 2 busy cores, wall time: 256: 0.4 s, 2,040: 3-15 s). With
        nothing decoding, prompts take the whole budget, unweighed: no stream waits for that step.

        While requests decode, the prompts share that budget: each running prompt, and the waiting requests
        together when one may be admitted (``admissible``: a seat is free), take at most an equal part of it.
        Running prompts took it first, in admission order, before: a 200-token prompt arriving while a
        2,000-token prompt was cut into chunks beside a stream was admitted on rounding leftovers (0-1 tokens
        a step) and got its first token after 13.3 s, when the first prompt's prefill ended.
        """
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        if not decoding:
            return PrefillBudget(self.max_num_batched_tokens, weigh_context=False)
        left = max(0, min(self.max_prefill_tokens_with_decodes, self.max_num_batched_tokens - decoding))
        prompts = sum(1 for r in running if r.num_tokens - r.num_computed_tokens > 1) + admissible
        return PrefillBudget(left, weigh_context=True, cap=-(-left // prompts) if prompts > 1 else None)

    def seats_to_reclaim(self, running: list[Request], waiting: Iterable[Request]) -> list[Request]:
        """The newest samples of requests holding more than ``max_seqs_per_group`` seats, as many as the
        requests waiting below their share need and the free seats do not cover, in the order to preempt.

        A request alone may use every seat (n=128 on an idle engine runs 64 at a time), but a later request
        must not wait for those to finish: with max_tokens in the thousands that was minutes without a token
        (issue 25 row 5). The preempted samples keep their tokens and recompute later (bitwise the same).
        """
        cap = self.max_seqs_per_group
        seats = Counter(r.group_id for r in running)
        waiting_by_group = Counter(r.group_id for r in waiting)
        wanted = sum(min(n, cap - seats[g]) for g, n in waiting_by_group.items() if seats[g] < cap)
        shortfall = wanted - (self.max_num_seqs - len(running))
        victims: list[Request] = []
        taken: set[str] = set()
        while shortfall > 0 and seats:
            group, held = seats.most_common(1)[0]
            if held <= cap:
                break
            victim = next(r for r in reversed(running) if r.group_id == group and r.request_id not in taken)
            victims.append(victim)
            taken.add(victim.request_id)
            seats[group] -= 1
            shortfall -= 1
        return victims

    def below_share(self, groups: set[str], seats: Counter) -> bool:
        """Whether any of ``groups`` holds fewer than ``max_seqs_per_group`` seats."""
        return any(seats[group] < self.max_seqs_per_group for group in groups)
