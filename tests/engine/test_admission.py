"""The prefill budget of a step (engine/admission.py): while requests decode, a prompt row costs more the
further into its prompt it is (a chunk's attention reads the whole context), so a long prompt's chunks
shrink as it goes and every stream's step stays short; with nothing decoding, a chunk takes the whole budget.
"""

from __future__ import annotations

from pagedkv.engine.admission import CONTEXT_STEP, CONTEXT_TOKENS_PER_ROW, SCORED_ROW_COST, FairShare
from pagedkv.engine.request import Request
from pagedkv.sampling_params import SamplingParams


def request(prompt_len: int, **params) -> Request:
    prompt = [10 + i % 50 for i in range(prompt_len)]
    return Request("r", "r", 0, prompt, prompt_len, SamplingParams(max_tokens=4, **params), block_size=0)


def decoding() -> Request:
    r = request(8)
    r.num_computed_tokens = 7  # one token left: a decode
    return r


FAIR = FairShare(max_num_seqs=8, max_num_batched_tokens=2048, max_seqs_per_group=4, max_prefill_tokens_with_decodes=64)


def chunks(prompt: Request, running: list[Request]) -> list[int]:
    """The chunk each step gives ``prompt`` until it is computed."""
    out = []
    while prompt.num_computed_tokens < prompt.num_prompt_tokens:
        budget = FAIR.prefill_budget(running)
        start = prompt.num_computed_tokens
        num_new = min(prompt.num_prompt_tokens - start, budget.chunk(prompt, start))
        budget.spend(prompt, start, num_new)
        assert budget.left >= 0 or num_new == 1  # a chunk fits, or it is the one token that always goes
        prompt.num_computed_tokens += num_new
        out.append(num_new)
    return out


def test_chunks_shrink_with_the_context_while_requests_decode():
    long = chunks(request(8000), [decoding()])
    starts = [sum(long[:i]) for i in range(len(long))]
    # 64 x 2048 // (2048 + the context before the chunk, in whole 256-token steps); the last is what is left
    assert all(c == 64 * 2048 // (2048 + s // 256 * 256) for s, c in zip(starts[:-1], long[:-1], strict=True))
    at = dict(zip(starts, long, strict=True))
    assert at[0] == 64 and at[max(s for s in starts if s < 2000)] == 34 and long[-2] == 13
    assert long[:-1] == sorted(long[:-1], reverse=True) and len(long) == 369  # 125 steps of 64 unweighed


def test_no_context_weight_when_nothing_decodes():
    assert chunks(request(5000), []) == [2048, 2048, 904]


def test_scored_rows_weigh_twice_and_the_context_on_top():
    scored = chunks(request(3000, prompt_logprobs=1), [decoding()])
    assert scored[0] == 64 // SCORED_ROW_COST
    last_start = sum(scored[:-2])
    context = last_start // CONTEXT_STEP * CONTEXT_STEP
    assert scored[-2] == 64 * CONTEXT_TOKENS_PER_ROW // ((CONTEXT_TOKENS_PER_ROW + context) * SCORED_ROW_COST)
    assert scored[-2] == 13  # 2,816 tokens in


def test_a_prompt_always_progresses():
    tiny = FairShare(8, 2048, 4, max_prefill_tokens_with_decodes=1)
    prompt = request(9000, prompt_logprobs=1)
    prompt.num_computed_tokens = 8500
    budget = tiny.prefill_budget([decoding()])
    assert budget.chunk(prompt, 8500) == 1
    budget.spend(prompt, 8500, 1)
    assert budget.left < 0 and budget.chunk(prompt, 8501) == 0  # spent: nothing more this step


def test_prompts_share_the_step_while_requests_decode():
    """A prompt arriving while a long one is cut into chunks is admitted with its part of the budget, not
    with what the long one left (0-1 tokens a step: its first token waited for the long prefill)."""
    long = request(2000)
    long.num_computed_tokens = 256  # one context step in: alone it would take 64 x 2048 // 2304 = 56
    budget = FAIR.prefill_budget([decoding(), long], admissible=True)
    assert budget.chunk(long, 256) == 32 * 2048 // 2304
    budget.spend(long, 256, 28)
    arriving = request(200)
    assert budget.chunk(arriving, 0) == 32  # what is left, within its part
    assert FAIR.prefill_budget([decoding(), long], admissible=False).chunk(long, 256) == 56
    assert FAIR.prefill_budget([long], admissible=True).chunk(long, 256) == 2048  # nothing decodes: unshared
