"""The Scheduler alone, driven by hand-made step results (tests/engine/harness.py): token budgets, chunked
prefill, preemption order, a request waiting on a prefix block another request is computing, stops, aborts
and failures -- and after every scenario, no request and no KV block left behind.

Block use is checked after every step against an independent model of the pool (harness.PoolModel).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.request import INTERNAL_ERROR, OutputKind
from pagedkv.sampler import SamplerOutput
from tests.engine.byte_tokenizer import ByteTokenizer
from tests.engine.harness import (
    EOS,
    Driver,
    assert_nothing_held,
    counting_model,
    greedy_reference,
    make_request,
    make_scheduler,
    run_checked,
)


def test_random_workloads_match_one_request_at_a_time_and_leak_nothing():
    """Budgets, chunks and preemption change when tokens are computed, never which tokens come out."""
    preemptions = chunked = 0
    for seed in range(6):
        rng = random.Random(seed)
        scheduler = make_scheduler(
            num_blocks=rng.randint(12, 40), max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(8, 48)
        )
        driver = Driver(scheduler)
        expected = {}
        for i in range(8):
            prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 30))]
            max_tokens = rng.randint(1, 12)
            make_request(scheduler, f"r{i}", prompt, max_tokens=max_tokens)
            expected[f"r{i}"] = greedy_reference(prompt, max_tokens)
        run_checked(driver)
        assert driver.outputs == expected, seed
        assert_nothing_held(scheduler)
        preemptions += scheduler.counters["num_preemptions"]
        prompt_steps = Counter(
            s.request.request_id for step in driver.steps for s in step.scheduled if s.num_new_tokens > 1
        )
        chunked += sum(1 for n in prompt_steps.values() if n > 1)
    assert preemptions and chunked  # the workloads did preempt and cut prompts into chunks


def test_a_long_prompt_is_computed_in_chunks_of_the_budget_and_sampled_once():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request(scheduler, "a", list(range(40, 60)), max_tokens=2)
    driver = Driver(scheduler)
    reports = [driver.step() for _ in range(3)]
    assert [s.scheduled[0].num_new_tokens for s in driver.steps] == [8, 8, 4]
    assert [r[0].new_token_ids for r in reports] == [[], [], [counting_model(list(range(40, 60)))]]
    assert request.num_computed_tokens == 20
    driver.run()
    assert_nothing_held(scheduler)


def test_decodes_keep_their_rows_while_a_prompt_is_chunked_beside_them():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_prefill_tokens_with_decodes=4)
    make_request(scheduler, "stream", [50, 51], max_tokens=20)
    driver = Driver(scheduler)
    driver.step()  # "stream" computed its prompt; it decodes from now on
    make_request(scheduler, "long", list(range(60, 90)), max_tokens=1)
    for _ in range(5):
        driver.step()
        scheduled = {s.request.request_id: s.num_new_tokens for s in driver.steps[-1].scheduled}
        assert scheduled["stream"] == 1
        assert scheduled["long"] <= 4  # the prompt shares the smaller budget while a request decodes
    driver.run()
    assert_nothing_held(scheduler)


def test_the_most_recently_admitted_request_is_preempted_and_goes_first_when_it_returns():
    # 7 blocks of 4: three 8-token prompts take 6; the next decode needs a block each.
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=64)
    prompts = {name: [20 + i] * 8 for i, name in enumerate("abc")}
    requests = {name: make_request(scheduler, name, prompt, max_tokens=6) for name, prompt in prompts.items()}
    driver = Driver(scheduler)
    driver.step()
    make_request(scheduler, "late", [90] * 3, max_tokens=1)
    driver.step()  # a takes the free block; b needs one: c, admitted last, is preempted
    assert [s.request.request_id for s in driver.steps[-1].scheduled] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "late"]
    assert requests["c"].num_computed_tokens == 0 and scheduler.kv.block_table("c") == []
    assert requests["c"].num_output_tokens == 1  # its sampled token is kept, recomputed later
    assert scheduler.counters["num_preemptions"] == 1
    run_checked(driver)
    for name, prompt in prompts.items():
        assert driver.outputs[name] == greedy_reference(prompt, 6)
    assert_nothing_held(scheduler)


def test_a_request_waits_a_step_for_a_prefix_block_another_request_is_computing():
    scheduler = make_scheduler(caching=True)
    system = list(range(100, 108))  # two full blocks both prompts share
    first = make_request(scheduler, "first", system + [40, 41, 42, 43, 44])
    second = make_request(scheduler, "second", system + [50, 51, 52])
    driver = Driver(scheduler)
    driver.step()
    assert [s.request for s in driver.steps[-1].scheduled] == [first]
    assert second.waited_for_block == 0
    driver.step()
    admitted = next(s for s in driver.steps[-1].scheduled if s.request is second)
    assert admitted.num_new_tokens == 3  # the shared blocks are a cache hit now
    assert (second.num_cached_tokens, second.cache_miss_reason) == (8, "waited")
    assert scheduler.kv.block_table("second")[:2] == scheduler.kv.block_table("first")[:2]
    driver.run()
    assert driver.outputs["second"] == greedy_reference(system + [50, 51, 52], 8)
    assert_nothing_held(scheduler)


def test_a_request_arriving_during_a_chunked_prefill_waits_for_the_blocks_in_flight():
    # While "stream" decodes, prompts share 8 tokens a step, so "first" computes its prompt in chunks.
    scheduler = make_scheduler(caching=True, max_prefill_tokens_with_decodes=8)
    make_request(scheduler, "stream", [5, 6], max_tokens=30)
    driver = Driver(scheduler)
    driver.step()
    system = list(range(100, 124))  # six blocks both prompts share
    first = make_request(scheduler, "first", system + [40])
    driver.step()
    second = make_request(scheduler, "second", system + [50])
    while scheduler.kv.block_table("second") == []:
        driver.step()
    assert first.num_computed_tokens >= 24  # admitted once the shared blocks were all computed
    assert (second.waited_for_block, second.num_cached_tokens, second.cache_miss_reason) == (2, 24, "waited")
    driver.run()
    assert_nothing_held(scheduler)


def test_without_prefix_caching_nobody_waits_for_anybody():
    scheduler = make_scheduler(caching=False)
    make_request(scheduler, "first", list(range(100, 113)))
    make_request(scheduler, "second", list(range(100, 111)))
    driver = Driver(scheduler)
    driver.step()
    assert [s.request.request_id for s in driver.steps[-1].scheduled] == ["first", "second"]
    driver.run()
    assert_nothing_held(scheduler)


def eos_after(num_outputs: int, prompt_len: int):
    """A model that says EOS as its output number ``num_outputs + 1``, counting otherwise."""
    return lambda history: EOS if len(history) == prompt_len + num_outputs else counting_model(history)


@pytest.mark.parametrize(
    ("params", "outputs", "reason", "stop_reason"),
    [
        ({}, 4, "stop", None),  # EOS: the 4th token
        ({"ignore_eos": True, "max_tokens": 6}, 6, "length", None),
        ({"min_tokens": 5, "max_tokens": 7}, 7, "length", None),  # an EOS before min_tokens does not stop
        ({"stop_token_ids": [12]}, 2, "stop", 12),  # prompt ends in 10: outputs 11, 12
        ({"max_tokens": 2}, 2, "length", None),
    ],
)
def test_token_level_stops(params, outputs, reason, stop_reason):
    scheduler = make_scheduler()
    request = make_request(scheduler, "a", [10], **params)
    driver = Driver(scheduler, model=eos_after(3, 1))
    reports = []
    while scheduler.requests:
        reports += driver.step()
    assert len(driver.outputs["a"]) == outputs
    assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)
    assert reports[-1].finish_reason == reason
    assert reports[-1].stop_token == (reason == "stop")  # EOS or a stop id: its text is left out
    assert scheduler.counters["requests_finished"] == 1
    assert_nothing_held(scheduler)


def test_max_model_len_ends_a_request_with_length():
    scheduler = make_scheduler(max_model_len=13)
    request = make_request(scheduler, "a", list(range(30, 40)), max_tokens=50)
    Driver(scheduler).run()
    assert request.num_output_tokens == 3 and request.finish_reason == "length"
    assert_nothing_held(scheduler)


def test_aborts_while_waiting_prefilling_or_scheduled_free_everything():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    chunked = make_request(scheduler, "chunked", list(range(40, 60)))
    decoding = make_request(scheduler, "decoding", [70])
    waiting = make_request(scheduler, "waiting", [80, 81])
    make_request(scheduler, "keeps", [90, 91], max_tokens=3)
    driver = Driver(scheduler)
    driver.step()
    assert chunked.is_prefilling and scheduler.kv.block_table("chunked")
    scheduler.finish(chunked, "abort")
    scheduler.finish(waiting, "abort")
    step = scheduler.schedule()
    scheduler.finish(decoding, "abort")  # between schedule and update: the update skips it
    reports = driver.finish_step(step)
    assert "decoding" not in {r.request_id for r in reports}
    assert [r.finish_reason for r in (chunked, waiting, decoding)] == ["abort"] * 3
    driver.run()
    assert driver.outputs["keeps"] == greedy_reference([90, 91], 3)
    assert scheduler.counters["requests_finished"] == 1  # aborts are not finished requests
    assert_nothing_held(scheduler)


def test_a_request_whose_rows_failed_stops_with_error_and_the_others_go_on():
    scheduler = make_scheduler()
    for name in "abc":
        make_request(scheduler, name, [ord(name)] * 5, max_tokens=4)
    driver = Driver(scheduler)
    driver.step()
    reports = {r.request_id: r for r in driver.step(failed=frozenset({"b"}))}
    assert reports["b"].finish_reason == "error" and reports["b"].new_token_ids == []
    assert scheduler.counters["requests_failed"] == 1
    driver.run()
    assert driver.outputs["a"] == greedy_reference([ord("a")] * 5, 4)
    assert driver.outputs["c"] == greedy_reference([ord("c")] * 5, 4)
    assert_nothing_held(scheduler)


def test_a_request_whose_update_fails_after_it_finished_reports_the_error_not_its_finish():
    """max_tokens=1: the update finishes the request ("length") with its first token, then reading its
    logprobs raises (a step result without top_logprobs). The error must win, through the output processor
    to the caller, or the client gets "length" and a truncated answer with no error."""
    scheduler = make_scheduler()
    make_request(scheduler, "r", [5, 6, 7], max_tokens=1, logprobs=1)
    processor = OutputProcessor(ByteTokenizer({i: b"x" for i in range(1, 40)}))  # ids 1..39: one byte each
    processor.add(processor.make_group([scheduler.requests["r"]], None, OutputKind.FINAL_ONLY))
    step = scheduler.schedule()
    broken = SamplerOutput([counting_model([5, 6, 7])], logprobs=[-0.5], top_logprobs=None)
    (core,) = scheduler.update_from_output(step, [(0, 1)], broken, set(), {})
    assert (core.finish_reason, core.stop_reason) == ("error", None)
    assert scheduler.counters["requests_failed"] == 1 and scheduler.counters["requests_finished"] == 0
    (output,), _ = processor.process([core])
    assert output.finished and output.outputs[0].finish_reason == "error" and output.error == INTERNAL_ERROR
    assert_nothing_held(scheduler)
