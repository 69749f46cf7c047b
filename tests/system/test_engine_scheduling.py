"""Scheduling must never change results: chunked prefill, preemption, batching, n > 1 -- and never leak blocks."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Name a colour.",
    "Why do cats purr? Answer briefly.",
    "Write one sentence about the moon and the tides, mentioning gravity.",
    "Count from one to five in words.",
    "What is the boiling point of water at sea level?",
]
GREEDY = SamplingParams(max_tokens=20, temperature=0)


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def _assert_no_blocks_held(llm: LLM) -> None:
    assert all(count == 0 for count in llm.engine.kv.ref_counts())
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference() -> tuple[LLM, list[list[int]]]:
    llm = LLM(attention_backend="gather", enable_prefix_caching=False)
    prompts = _prompts(llm)
    return llm, [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def test_chunked_prefill_with_tiny_budget(reference):
    base, expected = reference
    llm = LLM(attention_backend="gather", max_num_batched_tokens=7)
    outputs = llm.generate(prompt_token_ids=_prompts(base), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == expected
    _assert_no_blocks_held(llm)


def test_preemption_with_a_few_blocks(reference):
    base, expected = reference
    longest = max(len(p) for p in _prompts(base)) + GREEDY.max_tokens
    num_blocks = -(-longest // 16) + 2  # one request always fits, several never do
    llm = LLM(attention_backend="gather", num_kv_blocks=num_blocks)
    outputs = llm.generate(prompt_token_ids=_prompts(base), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats()["num_preemptions"] > 0
    _assert_no_blocks_held(llm)


def test_max_num_seqs_one_is_sequential(reference):
    base, expected = reference
    llm = LLM(attention_backend="gather", max_num_seqs=1)
    outputs = llm.generate(prompt_token_ids=_prompts(base), sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == expected


def test_seeded_sampling_is_reproducible_across_batches(reference):
    base, _ = reference
    prompts = _prompts(base)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = base.generate(prompt_token_ids=[prompts[2]], sampling_params=seeded)[0].token_ids
    mixed_params = [SamplingParams(max_tokens=16, temperature=1.2, seed=i) for i in range(len(prompts))]
    mixed_params[2] = seeded
    in_batch = base.generate(prompt_token_ids=prompts, sampling_params=mixed_params)[2].token_ids
    assert alone == in_batch
    other = base.generate(
        prompt_token_ids=[prompts[2]], sampling_params=SamplingParams(max_tokens=16, temperature=0.9, seed=99)
    )
    assert other[0].token_ids != alone


def test_stop_strings_are_trimmed(reference):
    base, _ = reference
    prompt = base.engine.apply_chat_template([{"role": "user", "content": "Describe a sunny day at the beach."}])
    full = base.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=40, temperature=0))[0]
    assert len(full.text) > 30, full.text
    # a stop string from the middle of the answer, three characters long, so it may span token boundaries
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = base.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids)
    kept = base.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(max_tokens=40, temperature=0, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_a_stop_token_s_text_is_kept_only_when_asked(reference):
    """stop_token_ids end the answer at that token; like vLLM, its text is in the output only with
    include_stop_str_in_output (the token id is in token_ids either way)."""
    base, _ = reference
    prompt = base.engine.apply_chat_template([{"role": "user", "content": "Describe a sunny day at the beach."}])
    full = base.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=12, temperature=0))[0]
    stop_at = next(i for i in range(3, 12) if base.tokenizer.decode(full.token_ids[i]).strip())  # a visible token
    stop_id = full.token_ids[stop_at]
    assert stop_id not in full.token_ids[:stop_at], "pick a token that first occurs there"
    texts = {}
    for include in (False, True):
        params = SamplingParams(
            max_tokens=12, temperature=0, stop_token_ids=[stop_id], include_stop_str_in_output=include
        )
        out = base.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        assert out.token_ids == full.token_ids[: stop_at + 1] and out.outputs[0].stop_reason == stop_id
        texts[include] = out.text
    assert texts[False] == base.tokenizer.decode(full.token_ids[:stop_at])
    assert texts[True] == base.tokenizer.decode(full.token_ids[: stop_at + 1])


def test_n_samples_share_prompt_blocks():
    llm = LLM(attention_backend="gather")
    system = "You are a helpful assistant who always answers in exactly one short sentence. " * 4
    prompt = llm.engine.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    )
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7)
    before = llm.stats()
    output = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    computed = llm.stats()["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert len(output.outputs) == 4 and [o.index for o in output.outputs] == [0, 1, 2, 3]
    block = llm.engine.kv.block_size
    assert computed <= len(prompt) + 3 * block, "the other samples should reuse the first one's full blocks"
    assert len({tuple(o.token_ids) for o in output.outputs}) > 1
    _assert_no_blocks_held(llm)


def test_bad_input_is_rejected_and_engine_keeps_serving(reference):
    base, expected = reference
    engine = base.engine
    with pytest.raises(ValueError, match="empty"):
        base.generate(prompt_token_ids=[[]], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        base.generate(prompt_token_ids=[[1] * (engine.max_model_len + 5)], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        base.generate(prompt_token_ids=[[10**9]], sampling_params=GREEDY)
    with pytest.raises(FileNotFoundError):
        LLM(model="/no/such/model.gguf")
    good = _prompts(base)
    outputs = base.generate(prompt_token_ids=good, sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == expected
    _assert_no_blocks_held(base)


def test_pool_too_small_for_a_request_is_a_clear_error():
    llm = LLM(attention_backend="gather", num_kv_blocks=2)
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": "Tell me a long story about dragons."}])
    with pytest.raises(ValueError, match="num_kv_blocks"):
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=64))
    _assert_no_blocks_held(llm)


def test_abort_frees_blocks():
    llm = LLM(attention_backend="gather")
    engine = llm.engine
    prompt = engine.apply_chat_template([{"role": "user", "content": "Write a long poem about autumn."}])
    request_id = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=200, temperature=0))
    for _ in range(3):
        engine.step()
    assert engine.kv.num_used_blocks > 0
    assert engine.abort(request_id)
    _assert_no_blocks_held(llm)
    assert not engine.abort(request_id)
