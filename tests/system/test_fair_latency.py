"""A victim stream keeps getting tokens while one other request is served (issue 25 rows 5 and 6), on the
default model, stepping the engine directly: it gets its first token in the step it is admitted in or the
next, then a token in every step to its last, and no step it waits for holds more than
``max_prefill_tokens_with_decodes`` prompt rows and one row per seat.

Counted in steps and rows, not timed: this machine is shared, and wall time measured the neighbours (one
decode step of 0.04 s took 2.4 s once). Before fair seats, an ``n`` larger than the seats kept the victim
queued until a sample finished (~300 steps here); before the prefill budget, a step held all of a
1,500-token prompt (~4.5 s on one core; 0.2-0.3 s at 64 tokens, a decode 0.01 s).
"""

from __future__ import annotations

import random

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import OutputKind

pytestmark = pytest.mark.slow


MAX_NUM_SEQS = 16
PREFILL_ROWS_WITH_DECODES = 64  # the default: prompt rows in a step while any request decodes
SHORT_STEP_ROWS = PREFILL_ROWS_WITH_DECODES + MAX_NUM_SEQS  # and one decode row per seat


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=MAX_NUM_SEQS, max_prefill_tokens_with_decodes=PREFILL_ROWS_WITH_DECODES, num_threads=1)


def _victim_steps(llm: LLM, victim_id: str, monkeypatch) -> list[tuple[int, bool]]:
    """Step the engine until the victim finishes; for each step, its rows and whether the victim got a token."""
    engine = llm.engine
    rows: list[int] = []
    schedule = engine.scheduler.schedule

    def noted():
        output = schedule()
        rows.append(sum(s.num_scheduled_tokens for s in output.scheduled))
        return output

    monkeypatch.setattr(engine.scheduler, "schedule", noted)
    steps = []
    while True:
        victim = {o.request_id: o for o in engine.step()}.get(victim_id)
        steps.append((rows[-1], victim is not None and bool(victim.outputs[0].delta_token_ids)))
        if victim is not None and victim.finished:
            return steps


def _assert_bounded(steps: list[tuple[int, bool]]) -> None:
    got = [token for _, token in steps]
    first = got.index(True)
    print(
        f"first token in step {first + 1}; {got.count(False)} of {len(steps)} steps without a token; "
        f"steps of up to {max(rows for rows, _ in steps)} rows"
    )
    assert first <= 1, f"the victim waited {first + 1} steps for its first token"
    assert all(got[first:]), f"the victim sat out {got[first:].count(False)} steps after its first token"
    assert max(rows for rows, _ in steps) <= SHORT_STEP_ROWS, [rows for rows, _ in steps]


def _assert_no_blocks_held(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert all(count == 0 for count in llm.engine.kv.ref_counts())


def _victim(llm: LLM, max_tokens: int) -> str:
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    victim_id = llm.engine.add_request(prompt_token_ids=prompt, params=params, output_kind=OutputKind.DELTA)
    return victim_id


def test_a_request_with_more_samples_than_seats_leaves_the_victim_a_seat(llm, monkeypatch):
    engine = llm.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": "Write a long story."}])
    big = engine.add_request(
        prompt_token_ids=prompt, params=SamplingParams(n=32, max_tokens=300, temperature=1.0, seed=1)
    )
    while len(engine.scheduler.running) < 16:
        engine.step()
    victim_id = _victim(llm, max_tokens=16)
    _assert_bounded(_victim_steps(llm, victim_id, monkeypatch))
    engine.abort(big)
    _assert_no_blocks_held(llm)


@pytest.mark.parametrize("prompt_logprobs", [None, 1], ids=["plain", "scored"])
def test_a_long_prompt_leaves_the_victim_short_steps(llm, prompt_logprobs, monkeypatch):
    engine = llm.engine
    victim_id = _victim(llm, max_tokens=40)
    for _ in range(5):
        engine.step()  # the victim decodes
    rng = random.Random(0)
    long = [rng.randrange(1000, 40000) for _ in range(1500)]
    engine.add_request(prompt_token_ids=long, params=SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs))
    _assert_bounded(_victim_steps(llm, victim_id, monkeypatch))
    while engine.has_unfinished_requests():
        engine.step()
    _assert_no_blocks_held(llm)
