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


def prefill_cost(request: Request, num_new: int) -> int:
    """What a prefill chunk of ``num_new`` tokens takes from the step's prefill budget."""
    return num_new * SCORED_ROW_COST if request.scores_prompt else num_new


def chunk_within(request: Request, budget: int) -> int:
    """The most prompt tokens of ``request`` whose cost fits in ``budget`` (at least one of a budget > 0, so
    a request scoring its prompt progresses under any ``max_num_batched_tokens``)."""
    return max(budget // SCORED_ROW_COST, min(budget, 1)) if request.scores_prompt else budget


@dataclass(slots=True)
class FairShare:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_seqs_per_group: int  # seats one request's n samples hold while others wait
    max_prefill_tokens_with_decodes: int

    def prefill_budget(self, running: Iterable[Request]) -> int:
        """Prompt tokens this step may compute (scored rows weigh more, see ``SCORED_ROW_COST``).

        Decode-first, as vLLM's chunked prefill: the decoding requests' rows are set aside, and while any
        request decodes, prompts get at most ``max_prefill_tokens_with_decodes``, since every stream waits for
        the whole step. The default model, 8 requests decoding, CPU time of a step on one thread: decodes
        alone 31 ms; with a chunk of 64 prompt tokens 0.20 s, 128: 0.39 s, 256: 0.79 s (~3 ms a token from 64
        up, so small chunks cost a long prompt no throughput), and a chunk's attention adds ~30 % per 1,000
        tokens of context before it (128 tokens: 0.39 s at the start of a prompt, 0.55 s at 1,400). The
        default, 64, keeps a step within ~0.5 s on one core up to ~4k tokens of context (on 2 busy cores,
        wall time: 256: 0.4 s, 2,040: 3-15 s). With nothing decoding, prompts take the whole budget.
        """
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        if not decoding:
            return self.max_num_batched_tokens
        return max(0, min(self.max_prefill_tokens_with_decodes, self.max_num_batched_tokens - decoding))

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
