"""Speculative drafts in the Scheduler, with hand-made step results: drafts proposed from the request's own
history, accepted while the model agrees, rejected from the first disagreement on; a stop inside the
accepted drafts ends the request there; a draft never preempts anyone. Greedy output is the same as
without drafts, checked against one-token-at-a-time decoding (tests/engine/harness.py).
"""

from __future__ import annotations

from tests.engine.harness import (
    Driver,
    assert_nothing_held,
    counting_model,
    greedy_reference,
    make_request,
    make_scheduler,
    run_checked,
)

# Counting from 10 to 29 and back to 10: once the output repeats the prompt's start, drafts are proposed.
PROMPT = list(range(10, 30)) + [10, 11]


def disagrees_at(*lengths: int):
    """The counting model, except that it says 77 after a history of one of ``lengths`` tokens."""
    return lambda history: 77 if len(history) in lengths else counting_model(history)


def first_decode_with_drafts(model, **params):
    """Prefill PROMPT (first token 12), then one decode step proposing drafts 13, 14, 15."""
    scheduler = make_scheduler(num_speculative_tokens=3)
    request = make_request(scheduler, "a", PROMPT, **params)
    driver = Driver(scheduler, model=model)
    driver.step()
    assert request.output_token_ids == [12]
    reports = driver.step()
    assert driver.steps[-1].scheduled[0].draft_token_ids == [13, 14, 15]
    return scheduler, request, reports[0]


def test_drafts_the_model_agrees_with_are_all_kept_with_its_own_next_token():
    scheduler, request, report = first_decode_with_drafts(counting_model)
    assert report.new_token_ids == [13, 14, 15, 16]
    assert request.num_computed_tokens == request.num_tokens - 1  # the new last token is computed next step
    assert (scheduler.counters["draft_tokens"], scheduler.counters["draft_tokens_accepted"]) == (3, 3)


def test_a_rejected_first_draft_keeps_only_the_model_s_token():
    scheduler, request, report = first_decode_with_drafts(disagrees_at(len(PROMPT) + 1))
    assert report.new_token_ids == [77]
    assert request.num_computed_tokens == request.num_tokens - 1  # the drafts' K/V does not count
    assert (scheduler.counters["draft_tokens"], scheduler.counters["draft_tokens_accepted"]) == (3, 0)


def test_drafts_after_the_first_disagreement_are_dropped():
    scheduler, request, report = first_decode_with_drafts(disagrees_at(len(PROMPT) + 2))
    assert report.new_token_ids == [13, 77]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.counters["draft_tokens_accepted"] == 1


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    scheduler, request, report = first_decode_with_drafts(counting_model, stop_token_ids=[14])
    assert report.new_token_ids == [13, 14]
    assert (report.finish_reason, report.stop_reason) == ("stop", 14)
    assert request.output_token_ids == [12, 13, 14]
    assert_nothing_held(scheduler)


def test_drafts_stay_within_max_tokens():
    scheduler = make_scheduler(num_speculative_tokens=3)
    make_request(scheduler, "a", PROMPT, max_tokens=3)
    driver = Driver(scheduler)
    driver.run()
    assert [len(s.draft_token_ids) for step in driver.steps for s in step.scheduled] == [0, 1]
    assert driver.outputs["a"] == [12, 13, 14]
    assert_nothing_held(scheduler)


def test_sampled_requests_take_no_drafts():
    scheduler = make_scheduler(num_speculative_tokens=3)
    make_request(scheduler, "a", PROMPT, temperature=0.8, seed=1)
    driver = Driver(scheduler)
    driver.run()
    assert all(not s.draft_token_ids for step in driver.steps for s in step.scheduled)
    assert_nothing_held(scheduler)


def test_a_draft_never_preempts_another_request():
    # 7 blocks of 4: "a" holds 6 for its 22-token prompt, "b" the 7th; a's drafts would need one more.
    scheduler = make_scheduler(num_blocks=7, num_speculative_tokens=3)
    make_request(scheduler, "a", PROMPT, max_tokens=4)
    make_request(scheduler, "b", [50, 51], max_tokens=2)
    driver = Driver(scheduler)
    driver.step()
    driver.step()
    scheduled = {s.request.request_id: s.draft_token_ids for s in driver.steps[-1].scheduled}
    assert scheduled == {"a": [], "b": []} and scheduler.counters["num_preemptions"] == 0
    driver.run()
    assert_nothing_held(scheduler)


def test_greedy_output_with_drafts_equals_decoding_one_token_at_a_time():
    """Many requests, a model that disagrees with the drafts now and then, a small pool: same tokens."""
    model = disagrees_at(*range(30, 200, 7))
    scheduler = make_scheduler(num_blocks=40, num_speculative_tokens=4, max_num_batched_tokens=24)
    driver = Driver(scheduler, model=model)
    prompts = {f"r{i}": PROMPT[i:] + PROMPT[:i] for i in range(6)}
    for name, prompt in prompts.items():
        make_request(scheduler, name, prompt, max_tokens=40)
    run_checked(driver)
    assert driver.outputs == {name: greedy_reference(p, 40, model) for name, p in prompts.items()}
    drafted, accepted = scheduler.counters["draft_tokens"], scheduler.counters["draft_tokens_accepted"]
    assert 0 < accepted < drafted  # drafts were both kept and rejected
    assert_nothing_held(scheduler)
