"""A Scheduler driven by hand, with no model: the step results are made up by a tiny deterministic "model".

vLLM tests its v1 scheduler the same way (``tests/v1/core/test_scheduler.py``): build the scheduler on a
real KV cache manager, call ``schedule()``, hand ``update_from_output`` the step result a runner would have
produced, and check what the scheduler decided. Here the made-up runner does what ``ModelRunner.prepare``
does for the rows -- one logits row per sampled request, plus one per draft -- and the "model" is a pure
function of the tokens before a row, so a run with drafts must give exactly the tokens of a run without.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.engine.request import CoreOutput, Request
from pagedkv.engine.scheduler import Scheduler, SchedulerOutput
from pagedkv.kv.manager import KVCacheManager
from pagedkv.sampler import SamplerOutput
from pagedkv.sampling_params import SamplingParams

EOS = 2
BLOCK_SIZE = 4

# The made-up model: the next token after a history (never EOS unless a test's model says so).
NextToken = Callable[[list[int]], int]


def counting_model(history: list[int]) -> int:
    """Next token = last + 1, wrapping within [10, 30): never EOS, and periodic, so drafts get proposed."""
    return 10 + (history[-1] + 1 - 10) % 20


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    num_speculative_tokens: int = 0,
    max_model_len: int = 1000,
    caching: bool = False,
    max_prefill_tokens_with_decodes: int | None = None,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching)
    return Scheduler(
        kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_speculative_tokens=num_speculative_tokens,
        max_model_len=max_model_len,
        eos_token_ids=frozenset({EOS}),
        max_seqs_per_group=max_num_seqs,
        max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes or max_num_batched_tokens,
    )


def make_request(scheduler: Scheduler, request_id: str, prompt: list[int], **params) -> Request:
    """A single-sample request, queued; ``params`` are SamplingParams fields (greedy unless given)."""
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 8)
    block_size = scheduler.kv.block_size if scheduler.kv.enable_prefix_caching else 0
    request = Request(
        request_id, request_id, 0, list(prompt), len(prompt), SamplingParams(**params), block_size=block_size
    )
    scheduler.add(request)
    return request


@dataclass
class Driver:
    """Runs steps on a scheduler: the made-up runner, plus a record of what each step scheduled."""

    scheduler: Scheduler
    model: NextToken = counting_model
    steps: list[SchedulerOutput] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # request id -> every token reported

    def step(self, failed: frozenset[str] = frozenset()) -> list[CoreOutput]:
        step = self.scheduler.schedule()
        self.steps.append(step)
        return self.finish_step(step, failed)

    def finish_step(self, step: SchedulerOutput, failed: frozenset[str] = frozenset()) -> list[CoreOutput]:
        """What the runner and sampler would report for ``step``: per sampled request, the model's token after
        its last known token and after each draft (the draft taken as given), in row order."""
        sampled, tokens = [], []
        for i, s in enumerate(step.scheduled):
            if not s.is_sampled:
                continue
            history = list(s.request.token_ids)
            for draft in [None, *s.draft_token_ids]:
                if draft is not None:
                    history.append(draft)
                tokens.append(self.model(history))
            sampled.append((i, 1 + len(s.draft_token_ids)))
        outputs = self.scheduler.update_from_output(step, sampled, SamplerOutput(tokens), set(failed), {})
        for core in outputs:
            self.outputs.setdefault(core.request_id, []).extend(core.new_token_ids)
        return outputs

    def run(self, max_steps: int = 500) -> None:
        """Step until no request is left (a test that loops forever fails here, not by hanging)."""
        for _ in range(max_steps):
            if not self.scheduler.requests:
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(self.scheduler.requests)}")


def assert_nothing_held(scheduler: Scheduler) -> None:
    """No request left anywhere and every block back in the pool (a leak fails here)."""
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert all(count == 0 for count in scheduler.kv.ref_counts())
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_total_blocks
    assert scheduler.kv.block_tables() == {}


def greedy_reference(prompt: list[int], max_tokens: int, model: NextToken = counting_model) -> list[int]:
    """What a request must output, one token at a time with no scheduler at all."""
    history, out = list(prompt), []
    for _ in range(max_tokens):
        token = model(history)
        history.append(token)
        out.append(token)
        if token == EOS:
            break
    return out


class PoolModel:
    """Blocks each request should hold, from what the steps scheduled (prefix caching off: nothing shared)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.reserved: dict[str, int] = {}

    def after_schedule(self, step) -> None:
        running = {r.request_id for r in self.scheduler.running}
        self.reserved = {rid: n for rid, n in self.reserved.items() if rid in running}  # preempted: gone
        for s in step.scheduled:
            need = s.request.num_computed_tokens + s.num_scheduled_tokens
            self.reserved[s.request.request_id] = max(self.reserved.get(s.request.request_id, 0), need)
        self.check()

    def check(self) -> None:
        running = {r.request_id for r in self.scheduler.running}
        kv = self.scheduler.kv
        for rid in list(self.reserved):
            if rid not in running:
                del self.reserved[rid]  # finished or failed
        expected = {rid: -(-n // BLOCK_SIZE) for rid, n in self.reserved.items()}
        assert {rid: len(t) for rid, t in kv.block_tables().items()} == expected
        assert kv.num_used_blocks == sum(expected.values())


def run_checked(driver: Driver, max_steps: int = 500) -> None:
    """Step to the end, checking the budgets and the pool model after every schedule and every update."""
    scheduler, pool = driver.scheduler, PoolModel(driver.scheduler)
    for _ in range(max_steps):
        if not scheduler.requests:
            return
        step = scheduler.schedule()
        driver.steps.append(step)
        assert sum(s.num_scheduled_tokens for s in step.scheduled) <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        assert len({s.request.request_id for s in step.scheduled}) == len(step.scheduled)
        pool.after_schedule(step)
        driver.finish_step(step)
        pool.check()
    raise AssertionError("requests left unfinished")
