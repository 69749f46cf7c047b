"""Batch invariance: the same request gives the same bits -- token ids, logprobs, prompt logprobs -- however
it was batched, cached, chunked, preempted, speculated, or threaded (README: Determinism).

Every comparison is ``==`` on Python floats, never a tolerance: a tolerance would hide exactly the drift
these tests exist to catch (a reduction whose order depends on the neighbours). The conditions run on a
tiny random Llama (4 heads of 64, 2 layers; contexts up to ~1,900 tokens, so the attention kernel's
fixed 512-token partitions are crossed) and, for the main ones, on the default model.
"""

from __future__ import annotations

import random

import pytest

from pagedkv import LLM, SamplingParams
from tests.tiny_model import save_tiny_llama

GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=3, prompt_logprobs=3)
PLAIN = SamplingParams(max_tokens=12, temperature=0)  # takes speculative drafts (logprobs requests do not)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234, logprobs=3, prompt_logprobs=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _prompts(seed: int) -> tuple[list[int], list[list[int]]]:
    """The request under test (with repeats, so prompt lookup proposes drafts) and 32 others of very
    different lengths, two of them longer than three kernel partitions."""
    rng = random.Random(seed)
    phrase = [rng.randrange(4, 512) for _ in range(9)]
    target = [rng.randrange(4, 512) for _ in range(70)] + phrase * 6 + [rng.randrange(4, 512) for _ in range(40)]
    lengths = [rng.choice([3, 17, 40, 130, 600]) for _ in range(30)] + [1700, 1900]
    rng.shuffle(lengths)
    return target, [[rng.randrange(4, 512) for _ in range(n)] for n in lengths]


def _bits(output) -> tuple:
    sample = output.outputs[0]
    return sample.token_ids, sample.logprobs, sample.top_logprobs, output.prompt_logprobs


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    return [_bits(o) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_request_gives_the_same_bits_under_every_condition(tiny, params, kv_dtype):
    """On fp16 pools too: other bits than fp32's, but each K/V value is rounded once, when written, whatever
    the batch, chunking, cache state or thread count."""
    target, others = _prompts(seed=11)
    everyone = [target, *others]
    mixed = [params] + [PLAIN] * len(others)

    def engine(**kwargs) -> LLM:
        blocks = kwargs.pop("num_kv_blocks", 1024)
        return LLM(model=tiny, num_kv_blocks=blocks, max_model_len=2048, kv_cache_dtype=kv_dtype, **kwargs)

    alone = _run(engine(enable_prefix_caching=False), [target], [params])[0]
    assert alone[0] and len(alone[3]) == len(target)

    cached = engine()
    assert _run(cached, [target], [params])[0] == alone  # cold
    assert _run(cached, [target], [params])[0] == alone  # warm: the prompt's blocks are cached
    assert cached.stats()["prefix_cache_hits"] > 0

    batch = engine()
    in_batch = _run(batch, everyone, mixed)  # next to 32 others, the target first ...
    assert in_batch[0] == alone
    reordered = _run(engine(), [*others[::-1], target], [PLAIN] * len(others) + [params])
    assert reordered[-1] == alone  # ... and last, after the prefix cache saw all of them
    assert reordered[:-1][::-1] == in_batch[1:]

    for budget in (7, 64, 333):  # chunked prefill at any chunk size
        assert _run(engine(max_num_batched_tokens=budget), everyone, mixed) == in_batch, budget

    tight = engine(num_kv_blocks=160)  # the two longest need 120 blocks together: someone is preempted
    assert _run(tight, everyone, mixed) == in_batch
    assert tight.stats()["num_preemptions"] > 0

    speculative = engine(num_speculative_tokens=3)  # drafts for the others, verified next to the target
    assert _run(speculative, everyone, mixed) == in_batch
    assert _run(speculative, [target], [PLAIN]) == _run(engine(), [target], [PLAIN])  # drafts for it too
    assert speculative.stats()["draft_tokens"] > 0  # proposed and run; a random model rarely agrees with them

    for threads in (1, 2):
        assert _run(engine(num_threads=threads), everyone, mixed) == in_batch, threads


@pytest.mark.slow
def test_default_model_alone_batched_cached_chunked_are_bitwise_equal():
    llm = LLM(num_kv_blocks=512, max_model_len=1024)
    questions = [
        "Which river flows through Vienna, and into which sea does it empty?",
        "hi",
        "List three prime numbers larger than 90 and explain briefly how you checked each one of them. " * 4,
        "What colour do you get by mixing blue and yellow paint?",
    ]
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    target = prompts[0]
    alone = _run(llm, [target], [GREEDY])[0]
    assert _run(llm, [target], [GREEDY])[0] == alone  # warm
    assert _run(llm, prompts, [GREEDY] * len(prompts))[0] == alone
    seeded_alone = _run(llm, [target], [SEEDED])[0]
    assert _run(llm, prompts[::-1], [SEEDED] * len(prompts))[-1] == seeded_alone
    chunked = LLM(num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=11, enable_prefix_caching=False)
    assert _run(chunked, prompts, [GREEDY] * len(prompts))[0] == alone
    plain = _run(chunked, prompts, [PLAIN] * len(prompts))
    speculative = LLM(num_kv_blocks=512, max_model_len=1024, num_speculative_tokens=4)
    assert _run(speculative, prompts, [PLAIN] * len(prompts)) == plain
    assert speculative.stats()["draft_tokens_accepted"] > 0
    codes = LLM(num_kv_blocks=512, max_model_len=1024, weight_format="gguf")  # the panel GEMM on the file's codes
    gguf_alone = _run(codes, [target], [GREEDY])[0]
    assert _run(codes, prompts[::-1], [GREEDY] * len(prompts))[-1] == gguf_alone
