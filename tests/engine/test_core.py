"""EngineCore with a fake runner: one logits row per sampled request and draft, peaked at the token the made-up
model of tests/engine/harness.py would choose, so the real Sampler picks it. Failures stay with their request:
a sampler fault or a grammar fault stops that request alone, a failed model call stops only the requests of
that step, and the core goes on serving; a lost tensor-parallel worker stops the engine with its error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from pagedkv.engine.core import EngineCore
from pagedkv.engine.request import CoreOutput
from pagedkv.engine.runner import StepResult
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.parallel.workers import TensorParallelFailure
from pagedkv.sampler import Sampler
from tests.engine.harness import (
    EOS,
    assert_nothing_held,
    counting_model,
    greedy_reference,
    make_request,
    make_scheduler,
)

VOCAB = 64


@dataclass
class FakeRunner:
    """Rows as ModelRunner.prepare lays them out; ``fail_when(step)`` raising stands for a failed model call."""

    fail_when: object = None
    model: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(spec=SimpleNamespace(vocab_size=VOCAB)))

    def execute(self, step: SchedulerOutput) -> StepResult:
        if self.fail_when is not None:
            self.fail_when(step)
        rows, sampled = [], []
        for i, s in enumerate(step.scheduled):
            if not s.is_sampled:
                continue
            history = list(s.request.token_ids)
            for draft in [None, *s.draft_token_ids]:
                history += [] if draft is None else [draft]
                rows.append(torch.nn.functional.one_hot(torch.tensor(counting_model(history)), VOCAB) * 10.0)
            sampled.append((i, 1 + len(s.draft_token_ids)))
        logits = torch.stack(rows) if rows else torch.empty(0, VOCAB)
        return StepResult(logits, sampled, {})


class FaultySampler(Sampler):
    """The real sampler, except that a batch holding one of the victims' params raises (a bug that one
    request's parameters trigger)."""

    def __init__(self, victims) -> None:
        super().__init__([EOS])
        self.victims = victims

    def __call__(self, logits, params, *args):
        if any(p is v for p in params for v in self.victims):
            raise RuntimeError("the sampler tripped on this request's parameters")
        return super().__call__(logits, params, *args)


def make_core(runner: FakeRunner | None = None, victims=(), **kwargs) -> EngineCore:
    return EngineCore(make_scheduler(**kwargs), runner or FakeRunner(), FaultySampler(victims))


def run(core: EngineCore, max_steps: int = 200) -> tuple[dict[str, list[int]], dict[str, CoreOutput]]:
    """Step until nothing is left; every request's reported tokens and its last report."""
    tokens: dict[str, list[int]] = {}
    last: dict[str, CoreOutput] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return tokens, last
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            last[out.request_id] = out
    raise AssertionError("requests left unfinished")


PROMPTS = {"a": [11, 12, 13], "b": [20, 21, 22, 23, 24, 25, 26], "c": [40] * 9}


@pytest.mark.parametrize("speculative", [0, 3])
def test_requests_come_out_as_the_model_decodes_them_one_at_a_time(speculative):
    core = make_core(num_speculative_tokens=speculative, max_num_batched_tokens=8)
    for name, prompt in PROMPTS.items():
        make_request(core.scheduler, name, prompt, max_tokens=30)
    tokens, last = run(core)
    assert tokens == {name: greedy_reference(p, 30) for name, p in PROMPTS.items()}
    assert {out.finish_reason for out in last.values()} == {"length"}
    assert core.stats()["kv_blocks_used"] == 0
    assert_nothing_held(core.scheduler)


def test_a_sampler_fault_stops_only_the_request_that_causes_it():
    core = make_core()
    requests = {name: make_request(core.scheduler, name, prompt, max_tokens=6) for name, prompt in PROMPTS.items()}
    core.sampler.victims = [requests["b"].params]
    tokens, last = run(core)
    assert last["b"].finish_reason == "error" and tokens["b"] == []
    assert tokens["a"] == greedy_reference(PROMPTS["a"], 6) and tokens["c"] == greedy_reference(PROMPTS["c"], 6)
    assert core.stats()["requests_failed"] == 1
    assert_nothing_held(core.scheduler)


def test_a_failed_model_call_stops_that_step_s_requests_and_the_core_goes_on():
    def fail_on_b(step):
        if any(s.request.request_id == "b" for s in step.scheduled):
            raise RuntimeError("the model call failed")

    core = make_core(FakeRunner(fail_when=fail_on_b), max_num_seqs=1)  # one request a step: b's step is b's alone
    for name, prompt in PROMPTS.items():
        make_request(core.scheduler, name, prompt, max_tokens=5)
    tokens, last = run(core)
    assert last["b"].finish_reason == "error"
    assert tokens["a"] == greedy_reference(PROMPTS["a"], 5) and tokens["c"] == greedy_reference(PROMPTS["c"], 5)
    assert_nothing_held(core.scheduler)


class BrokenGrammar:
    """A structured-outputs matcher whose every call fails (a grammar engine bug for this request)."""

    def __getattr__(self, name):
        raise RuntimeError(f"grammar.{name} failed")


def test_a_grammar_fault_stops_only_its_request():
    core = make_core()
    requests = {name: make_request(core.scheduler, name, prompt, max_tokens=4) for name, prompt in PROMPTS.items()}
    requests["c"].grammar = BrokenGrammar()
    tokens, last = run(core)
    assert last["c"].finish_reason == "error"
    assert tokens["a"] == greedy_reference(PROMPTS["a"], 4) and tokens["b"] == greedy_reference(PROMPTS["b"], 4)
    assert_nothing_held(core.scheduler)


def test_finish_stops_requests_by_id_and_ignores_unknown_ones():
    core = make_core()
    for name, prompt in PROMPTS.items():
        make_request(core.scheduler, name, prompt, max_tokens=50)
    first = {out.request_id: out.new_token_ids for out in core.step()}
    core.finish(["b", "no-such-request"], "abort")
    tokens, _ = run(core)
    assert "b" not in tokens  # an aborted request is not reported again
    assert first["a"] + tokens["a"] == greedy_reference(PROMPTS["a"], 50)
    assert_nothing_held(core.scheduler)


def test_a_lost_tensor_parallel_worker_stops_the_engine_with_its_error():
    def lose_worker(step):
        raise TensorParallelFailure("rank 1 stopped answering")

    core = make_core(FakeRunner(fail_when=lose_worker))
    make_request(core.scheduler, "a", PROMPTS["a"])
    with pytest.raises(TensorParallelFailure, match="rank 1"):
        core.step()
