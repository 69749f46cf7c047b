"""Prompt scoring (``SamplingParams.prompt_logprobs``) on the default model, against HF transformers'
``log_softmax`` of its own logits, and its interplay with generation, n > 1, the cache and preemption."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request import OutputKind

pytestmark = pytest.mark.slow

TEXT = (
    "The lighthouse keeper counted forty-one ships before noon, wrote each name in the ledger, and "
    "then, because the fog came in early, lit the lamp an hour before sunset."
)
SCORE = SamplingParams(prompt_logprobs=5, max_tokens=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256, max_model_len=1024)


def test_prompt_logprobs_match_hf_log_softmax(llm, hf_default_model):
    ids = llm.engine.encode(TEXT)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SCORE, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and out.finish_reason == "length"
    with torch.no_grad():
        reference = hf_default_model(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row, token = reference[position - 1], ids[position]
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) <= 1e-4
        # the rank may differ only where HF's logits are within the tolerance of the token's own
        assert (row > row[token] + 1e-4).sum() + 1 <= entry.rank <= (row > row[token] - 1e-4).sum() + 1
        for top_token, logprob in entry.top_logprobs:
            assert abs(logprob - row[top_token].item()) <= 1e-4
        expected_values = row.topk(5).values.tolist()
        assert max(abs(a - b) for (_, a), b in zip(entry.top_logprobs, expected_values, strict=True)) <= 1e-4


def test_scores_are_the_same_bits_cold_warm_and_chunked_without_the_cache(llm):
    ids = llm.engine.encode(TEXT * 3)
    llm.reset_prefix_cache()
    cold = llm.generate(prompt_token_ids=[ids], sampling_params=SCORE, use_tqdm=False)[0]
    warm = llm.generate(prompt_token_ids=[ids], sampling_params=SCORE, use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0
    assert warm.prompt_logprobs == cold.prompt_logprobs
    chunked = LLM(num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=13, enable_prefix_caching=False)
    assert chunked.generate(prompt_token_ids=[ids], sampling_params=SCORE)[0].prompt_logprobs == cold.prompt_logprobs


def test_scoring_while_generating_with_n_samples_changes_no_token(llm):
    ids = llm.engine.apply_chat_template([{"role": "user", "content": "Name two planets."}])
    plain = SamplingParams(max_tokens=8, temperature=0.7, seed=5, n=2)
    scored = SamplingParams(max_tokens=8, temperature=0.7, seed=5, n=2, prompt_logprobs=1)
    out_plain, out_scored = (llm.generate(prompt_token_ids=[ids], sampling_params=p)[0] for p in (plain, scored))
    assert [s.token_ids for s in out_scored.outputs] == [s.token_ids for s in out_plain.outputs]
    assert len(out_scored.prompt_logprobs) == len(ids) and out_plain.prompt_logprobs is None
    alone = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(prompt_logprobs=1, max_tokens=0))[0]
    assert out_scored.prompt_logprobs == alone.prompt_logprobs


def test_streamed_outputs_carry_the_scores_from_the_first_token(llm):
    ids = llm.engine.encode(TEXT)
    engine = llm.engine
    request_id = engine.add_request(
        prompt_token_ids=ids,
        params=SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0),
        output_kind=OutputKind.DELTA,
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    with_tokens = [o for o in outputs if o.outputs[0].delta_token_ids]
    assert with_tokens and all(o.prompt_logprobs is not None for o in with_tokens)
    assert all(len(o.prompt_logprobs) == len(ids) for o in with_tokens)


def test_a_preempted_scoring_request_still_scores_right(llm):
    ids = llm.engine.encode(TEXT * 2)
    expected = llm.generate(prompt_token_ids=[ids], sampling_params=SCORE)[0].prompt_logprobs
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    tight = LLM(num_kv_blocks=-(-len(ids) // 16) + 6, max_model_len=1024, max_num_batched_tokens=32)
    others = [llm.engine.encode(f"Story {i}: " + TEXT[: 40 + 9 * i]) for i in range(3)]
    outs = tight.generate(prompt_token_ids=[*others, ids], sampling_params=[long] * 3 + [SCORE])
    assert tight.stats()["num_preemptions"] > 0
    assert outs[-1].prompt_logprobs == expected
    assert tight.stats()["kv_blocks_free"] == tight.stats()["kv_blocks_total"]
