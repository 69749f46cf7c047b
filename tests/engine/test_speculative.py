"""Prompt-lookup speculative decoding: the proposer against a plain loop, and the engine's greedy output unchanged."""

from __future__ import annotations

import random

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine import speculative
from pagedkv.engine.speculative import accepted_length, propose


def reference_propose(tokens: list[int], k: int) -> list[int]:
    """The same rule written as the obvious double loop: longest n first, latest earlier occurrence."""
    for n in range(speculative.MAX_NGRAM, speculative.MIN_NGRAM - 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def test_propose_matches_the_loop_on_random_histories() -> None:
    rng = random.Random(0)
    found = 0
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(0, 6)
        expected = reference_propose(tokens, k) if k else []
        assert propose(tokens, k) == expected, (tokens, k)
        found += bool(expected)
    assert found > 500  # the comparison exercised real matches, not just empty proposals


def test_propose_prefers_the_longest_and_latest_match() -> None:
    assert propose([7, 1, 2, 9, 5, 1, 2, 8, 3, 1, 2], 2) == [8, 3]  # latest "1 2" wins over the first
    assert propose([1, 2, 3, 6, 9, 2, 3, 7, 1, 2, 3], 1) == [6]  # "1 2 3" (n = 3) beats the later "2 3"
    assert propose([5, 6, 5, 6], 3) == [5, 6]  # what follows may run into the suffix itself
    assert propose([1, 2, 3], 4) == []


def test_accepted_length() -> None:
    assert accepted_length([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_length([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_length([4, 5, 6], [0, 5, 6, 7]) == 0
    assert accepted_length([], [3]) == 0


REPEAT = "Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, melons."
OTHER = ["What is the capital of France?", "Count from one to ten in words.", "hi"]


@pytest.mark.slow
def test_greedy_outputs_are_unchanged_and_blocks_come_back() -> None:
    llm = LLM(attention_backend="gather", num_speculative_tokens=4)
    chats = [[{"role": "user", "content": q}] for q in [REPEAT, *OTHER]]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (60, 40, 13, 7)]  # odd budgets: drafts cut short
    with_drafts = llm.chat(chats, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["draft_tokens_accepted"] > 10, stats  # the repetition prompt really ran on drafts
    assert stats["draft_tokens_accepted"] < stats["draft_tokens"]  # and rejections happened too
    assert llm.engine.kv.num_used_blocks == 0
    llm.engine.scheduler.num_speculative_tokens = 0
    plain = llm.chat(chats, params, use_tqdm=False)
    assert [o.token_ids for o in with_drafts] == [o.token_ids for o in plain]
    assert [o.text for o in with_drafts] == [o.text for o in plain]
    for out, p in zip(with_drafts, params, strict=True):
        assert len(out.token_ids) <= p.max_tokens
        assert out.finish_reason == "stop" or len(out.token_ids) == p.max_tokens
    assert llm.stats()["draft_tokens"] == stats["draft_tokens"]  # switched off: no new drafts


@pytest.mark.slow
def test_sampled_and_penalised_requests_get_no_drafts() -> None:
    llm = LLM(attention_backend="gather", num_speculative_tokens=4)
    chat = [[{"role": "user", "content": REPEAT}]]
    llm.chat(chat, SamplingParams(max_tokens=30, temperature=0.7, seed=1), use_tqdm=False)
    llm.chat(chat, SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.2), use_tqdm=False)
    llm.chat(chat, SamplingParams(max_tokens=30, temperature=0, logprobs=2), use_tqdm=False)
    assert llm.stats()["draft_tokens"] == 0
    assert llm.engine.kv.num_used_blocks == 0


def test_config_rejects_negative_drafts() -> None:
    from pagedkv.config import EngineConfig

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)


@pytest.mark.slow
def test_streamed_deltas_add_up_and_stop_strings_cut_inside_a_draft() -> None:
    """A step may now add several tokens: the deltas must still add up to the final text, and a stop string
    that completes inside an accepted draft must end the output exactly where it does without drafts."""
    llm = LLM(attention_backend="gather", num_speculative_tokens=4)
    engine = llm.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": REPEAT}])
    results = {}
    for drafts in (4, 0):
        engine.scheduler.num_speculative_tokens = drafts
        for stop in ([], ["grapes"]):
            rid = engine.add_request(
                prompt_token_ids=prompt, params=SamplingParams(max_tokens=60, temperature=0, stop=stop)
            )
            text, tokens, final = "", [], None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    assert out.request_id == rid
                    text += out.outputs[0].delta_text
                    tokens += out.outputs[0].delta_token_ids
                    final = out
            assert final is not None and final.finished
            assert text == final.outputs[0].text and tokens == final.outputs[0].token_ids
            results[drafts, tuple(stop)] = (text, final.outputs[0].finish_reason)
    assert llm.stats()["draft_tokens_accepted"] > 0
    assert results[4, ()] == results[0, ()]
    assert results[4, ("grapes",)] == results[0, ("grapes",)]
    assert "grapes" in results[0, ()][0]  # the stop string really occurs, so the cut was exercised
    assert results[0, ("grapes",)][1] == "stop"
    assert engine.kv.num_used_blocks == 0
