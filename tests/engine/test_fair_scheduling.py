"""Fair seats and fair steps (issue 25 rows 5 and 6), on the Scheduler alone: no model, each step's sampled
token is made up, so a test of hundreds of steps runs in well under a second.

- one request (its n samples) holds at most ``max_seqs_per_group`` seats while other requests wait, and a
  request that took every seat on an idle engine gives back what a later request needs (by preemption);
- waiting requests are admitted by request, the one holding the fewest seats first, not sample by sample;
- while any request decodes, a step computes at most ``max_prefill_tokens_with_decodes`` prompt tokens (a
  scored prompt row counts ``SCORED_ROW_COST``), and the decoding rows always fit in the step.
"""

from __future__ import annotations

from collections import Counter

from pagedkv.engine.admission import SCORED_ROW_COST
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import Scheduler
from pagedkv.kv.manager import KVCacheManager
from pagedkv.sampler import SamplerOutput
from pagedkv.sampling_params import SamplingParams

EOS = 3
TOKEN = 7  # every made-up sampled token: never EOS, so requests run to max_tokens


def make_scheduler(max_num_seqs=8, share=4, batched=2048, with_decodes=64, num_blocks=512, caching=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs, batched, 0, 100_000, frozenset({EOS}), share, with_decodes)


def add(scheduler: Scheduler, group: str, n=1, prompt_len=20, max_tokens=1000, **params) -> list[Request]:
    prompt = [10 + sum(map(ord, group)) % 400 + i % 50 for i in range(prompt_len)]
    requests = [
        Request(
            f"{group}-{i}",
            group,
            i,
            list(prompt),
            prompt_len,
            SamplingParams(max_tokens=max_tokens, temperature=0, **params),
            block_size=16 if scheduler.kv.enable_prefix_caching else 0,  # the engine's: no keys without the cache
        )
        for i in range(n)
    ]
    for request in requests:
        scheduler.add(request)
    return requests


def step(scheduler: Scheduler):
    """One schedule + update, every sampled row getting TOKEN; returns the step's ScheduledRequests."""
    out = scheduler.schedule()
    sampled = [(i, s.num_scheduled_tokens) for i, s in enumerate(out.scheduled) if s.is_sampled]
    tokens = SamplerOutput(token_ids=[TOKEN] * sum(n for _, n in sampled))
    scheduler.update_from_output(out, sampled, tokens, set(), {})
    return out.scheduled


def seats(scheduler: Scheduler) -> Counter:
    return Counter(r.group_id for r in scheduler.running)


def assert_fair(scheduler: Scheduler) -> None:
    """No request holds more than its share of seats while a request holding fewer than its share waits."""
    held = seats(scheduler)
    under_share_waiting = {r.group_id for r in scheduler.waiting if held[r.group_id] < scheduler.max_seqs_per_group}
    for group, n in held.items():
        if n > scheduler.max_seqs_per_group:
            assert not under_share_waiting - {group}, (held, under_share_waiting)


def assert_no_blocks_held(scheduler: Scheduler) -> None:
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert all(count == 0 for count in scheduler.kv.ref_counts())


def test_a_request_alone_takes_every_seat_and_gives_back_what_a_later_one_needs():
    scheduler = make_scheduler(max_num_seqs=8, share=4)
    add(scheduler, "big", n=16, max_tokens=50)
    for _ in range(3):
        step(scheduler)
    assert seats(scheduler) == {"big": 8}  # alone: every seat, nobody waits for them
    add(scheduler, "victim", max_tokens=5)
    scheduled = step(scheduler)
    assert any(s.request.group_id == "victim" for s in scheduled), "the later request starts at once"
    assert seats(scheduler) == {"big": 7, "victim": 1}  # one seat reclaimed, not the whole share
    add(scheduler, "many", n=8, max_tokens=5)
    step(scheduler)
    assert seats(scheduler)["big"] == 4 and seats(scheduler)["many"] == 3
    preemptions = scheduler.counters["num_preemptions"]
    while scheduler.requests:
        step(scheduler)
        assert_fair(scheduler)
    assert preemptions == 4
    assert_no_blocks_held(scheduler)


def test_waiting_requests_are_admitted_by_request_not_by_sample():
    scheduler = make_scheduler(max_num_seqs=8, share=8)  # every seat may go to one request: order alone
    add(scheduler, "a", n=6)
    add(scheduler, "b", n=6)
    add(scheduler, "c")
    step(scheduler)
    assert seats(scheduler) == {"a": 4, "b": 3, "c": 1}  # round by round: a b c a b a b a
    # before: arrival order, a's six samples, then two of b's, c none


def test_requests_past_their_shares_take_free_seats_in_turn():
    scheduler = make_scheduler(max_num_seqs=8, share=2)
    add(scheduler, "a", n=6)
    add(scheduler, "b", n=6)
    step(scheduler)
    assert seats(scheduler) == {"a": 4, "b": 4}  # no seat idle while requests wait, none ahead of the other
    add(scheduler, "c", n=1, max_tokens=3)
    step(scheduler)
    assert seats(scheduler) == {"a": 3, "b": 4, "c": 1}  # one seat back from a request past its share


def test_the_prefill_chunk_shrinks_while_decodes_run():
    scheduler = make_scheduler(max_num_seqs=8, batched=2048, with_decodes=64)
    add(scheduler, "long-alone", prompt_len=3000, max_tokens=1)
    assert [s.num_new_tokens for s in step(scheduler)] == [2048]  # nothing decodes: the whole budget
    while scheduler.requests:
        step(scheduler)
    add(scheduler, "stream", n=3)
    step(scheduler)
    long = add(scheduler, "long", prompt_len=1000, max_tokens=2)[0]
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        scheduled = step(scheduler)
        decodes = [s for s in scheduled if s.request.group_id == "stream"]
        assert len(decodes) == 3 and all(s.num_new_tokens == 1 for s in decodes), "every stream, every step"
        chunks += [s.num_new_tokens for s in scheduled if s.request is long]
    assert sum(chunks) == 1000 and max(chunks) == 64


def test_scored_prompt_rows_count_more_in_the_prefill_budget():
    scheduler = make_scheduler(with_decodes=64)
    add(scheduler, "stream")
    step(scheduler)
    add(scheduler, "scored", prompt_len=500, max_tokens=1, prompt_logprobs=1)
    step(scheduler)
    scored = scheduler.running[-1]
    chunks = []
    while scored.is_prefilling:
        chunks += [s.num_new_tokens for s in step(scheduler) if s.request is scored]
    assert max(chunks) == 64 // SCORED_ROW_COST


def test_decoding_rows_always_fit_before_a_prompt_chunk():
    """A prompt ahead of decoding requests in the running order never takes their rows (decode-first)."""
    scheduler = make_scheduler(max_num_seqs=8, batched=24, with_decodes=24)
    add(scheduler, "stream", n=5, prompt_len=4)
    step(scheduler)
    long = add(scheduler, "long", prompt_len=400, max_tokens=2)[0]
    step(scheduler)
    scheduler.running.insert(0, scheduler.running.pop())  # the order is admission order; any order must do
    assert scheduler.running[0] is long and long.is_prefilling
    while long.is_prefilling:
        scheduled = step(scheduler)
        assert sum(s.num_scheduled_tokens for s in scheduled) <= 24
        assert sum(1 for s in scheduled if s.request.group_id == "stream") == 5
    while scheduler.requests:
        step(scheduler)
    assert_no_blocks_held(scheduler)


def test_fairness_with_the_prefix_cache_and_a_small_pool_leaks_nothing():
    """Seat reclaims, pool preemptions and deferred admissions (n samples sharing prompt blocks) together."""
    scheduler = make_scheduler(max_num_seqs=6, share=3, batched=64, with_decodes=16, num_blocks=40, caching=True)
    add(scheduler, "big", n=12, prompt_len=70, max_tokens=40)
    for i in range(40):
        if i % 5 == 0:
            add(scheduler, f"small{i}", n=1 + i % 3, prompt_len=30 + i, max_tokens=10)
        step(scheduler)
        assert_fair(scheduler)
    while scheduler.requests:
        step(scheduler)
    assert scheduler.counters["num_preemptions"] > 0
    assert_no_blocks_held(scheduler)


def test_a_warm_prompt_scored_in_chunks_shorter_than_its_cache_hit(tmp_path):
    """Small prefill chunks meet a long prefix-cache hit when a warm prompt is scored (it recomputes from 0
    over its cached blocks): the runner marked the whole hit's rows as not-to-write in the first chunk, past
    the chunk's end (an IndexError, the request failed). Cold and warm give the same bits."""
    from pagedkv import LLM
    from tests.tiny_model import save_tiny_llama

    llm = LLM(model=str(save_tiny_llama(tmp_path)), max_num_batched_tokens=32, num_kv_blocks=64)
    prompt = [4 + i * 7 % 500 for i in range(150)]
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    cold, warm = (llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0] for _ in range(2))
    assert warm.num_cached_tokens >= 128 and warm.outputs[0].finish_reason == "length"
    assert (warm.token_ids, warm.prompt_logprobs) == (cold.token_ids, cold.prompt_logprobs)
    assert all(count == 0 for count in llm.engine.kv.ref_counts())
