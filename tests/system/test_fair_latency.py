"""A victim stream keeps getting tokens while one other request is served (issue 25 rows 5 and 6), on the
default model, stepping the engine directly: its largest gap between tokens -- from its arrival to its first
token, and between tokens -- stays within 3x its median gap + 0.5 s.

Gaps are the engine's CPU time on one thread, not wall time: this machine is shared, and wall time measured
the neighbours (one decode step of 0.04 s took 2.4 s once). Before fair seats, an ``n`` larger than the
seats kept the victim queued until a sample finished (~300 steps here); before the prefill budget, a step
held all of a 1,500-token prompt (~4.5 s on one core; 0.2-0.3 s at 64 tokens, a decode 0.01 s).
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import OutputKind

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=16, num_threads=1)


def _victim_gaps(llm: LLM, victim_id: str, arrived: float) -> list[float]:
    """Step the engine until the victim finishes; the gaps before each of its new tokens."""
    engine = llm.engine
    last, gaps = arrived, []
    while True:
        outputs = {o.request_id: o for o in engine.step()}
        victim = outputs.get(victim_id)
        if victim is not None and victim.outputs[0].delta_token_ids:
            now = time.process_time()
            gaps.append(now - last)
            last = now
        if victim is not None and victim.finished:
            return gaps


def _assert_bounded(gaps: list[float]) -> None:
    bound = 3 * statistics.median(gaps) + 0.5
    assert max(gaps) <= bound, f"largest gap {max(gaps):.2f} s > {bound:.2f} s: {[round(g, 2) for g in gaps]}"


def _assert_no_blocks_held(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert all(count == 0 for count in llm.engine.kv.ref_counts())


def _victim(llm: LLM, max_tokens: int) -> tuple[str, float]:
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    victim_id = llm.engine.add_request(prompt_token_ids=prompt, params=params, output_kind=OutputKind.DELTA)
    return victim_id, time.process_time()


def test_a_request_with_more_samples_than_seats_leaves_the_victim_a_seat(llm):
    engine = llm.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": "Write a long story."}])
    big = engine.add_request(
        prompt_token_ids=prompt, params=SamplingParams(n=32, max_tokens=300, temperature=1.0, seed=1)
    )
    while len(engine.scheduler.running) < 16:
        engine.step()
    victim_id, arrived = _victim(llm, max_tokens=16)
    _assert_bounded(_victim_gaps(llm, victim_id, arrived))
    engine.abort(big)
    _assert_no_blocks_held(llm)


@pytest.mark.parametrize("prompt_logprobs", [None, 1], ids=["plain", "scored"])
def test_a_long_prompt_leaves_the_victim_short_steps(llm, prompt_logprobs):
    engine = llm.engine
    victim_id, arrived = _victim(llm, max_tokens=40)
    for _ in range(5):
        engine.step()  # the victim decodes
    rng = random.Random(0)
    long = [rng.randrange(1000, 40000) for _ in range(1500)]
    engine.add_request(prompt_token_ids=long, params=SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs))
    _assert_bounded(_victim_gaps(llm, victim_id, arrived))
    while engine.has_unfinished_requests():
        engine.step()
    _assert_no_blocks_held(llm)
