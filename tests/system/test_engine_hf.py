"""The whole engine on the default model, checked token by token against HF transformers (fp32, greedy)."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers.",
    "hi",
    "Translate 'good morning' into Spanish and German, and say which languages they are.",
    "What is 12 times 13? Answer with the number only.",
    "Give me a short tip for learning to play the guitar, in one sentence, and make it friendly "
    "and encouraging for a complete beginner who has never held an instrument before.",
]
MAX_TOKENS = 24
TIE_GAP = 1e-3


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(weight_format="float32", attention_backend="gather")


@pytest.fixture(scope="module")
def chat_prompts(llm: LLM) -> list[list[int]]:
    return [llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(hf_default_model, chat_prompts) -> list[tuple[list[int], list[torch.Tensor]]]:
    """HF's greedy tokens and per-step logits, one prompt at a time (no padding)."""
    results = []
    for prompt in chat_prompts:
        out = hf_default_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=2,
            pad_token_id=2,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        results.append((tokens, [step[0].float() for step in out.logits]))
    return results


def _compare(ours: list[int], theirs: list[int], logits: list[torch.Tensor]) -> int:
    """Assert equal up to the first near tie; returns 1 if a near tie flipped a token, else 0."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        logprobs = torch.log_softmax(logits[step], dim=-1)
        top2 = torch.topk(logprobs, 2)
        assert top2.indices[1].item() == a, f"step {step}: ours {a} is not HF's second choice {top2.indices.tolist()}"
        gap = (top2.values[0] - top2.values[1]).item()
        assert gap < TIE_GAP, f"step {step}: tokens differ ({a} vs {b}) with a logprob gap of {gap:.2e}"
        return 1
    assert len(ours) == len(theirs), f"lengths differ: {len(ours)} vs {len(theirs)}"
    return 0


def test_batched_greedy_matches_hf(llm, chat_prompts, hf_greedy):
    outputs = llm.generate(
        prompt_token_ids=chat_prompts, sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    )
    ties = sum(_compare(o.token_ids, tokens, logits) for o, (tokens, logits) in zip(outputs, hf_greedy))
    print(f"\nnear-tie flips accepted: {ties} of {len(chat_prompts)} prompts")
    assert ties <= 2
    assert all(o.text for o in outputs)


def test_prefix_cache_on_off_and_warm_rerun(llm, chat_prompts, hf_greedy):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    system = "You are a terse assistant that answers questions about geography and arithmetic in few words. " * 3
    prompts = [
        llm.engine.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]
    llm.reset_prefix_cache()
    cold = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    warm = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    block = llm.engine.kv.block_size
    for prompt, c, w in zip(prompts, cold, warm):
        assert c.token_ids == w.token_ids
        assert w.num_cached_tokens >= (len(prompt) - 1) // block * block
        assert len(prompt) - w.num_cached_tokens <= block
    off = LLM(weight_format="float32", attention_backend="gather", enable_prefix_caching=False)
    uncached = off.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in uncached] == [o.token_ids for o in cold]
    assert all(o.num_cached_tokens == 0 for o in uncached)
