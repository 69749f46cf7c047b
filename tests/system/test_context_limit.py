"""max_tokens past the context (issue 25 row 11): prompt + max_tokens > max_model_len is refused in vLLM's
words, offline as on the server, unless max_tokens_policy="clamp"; max_tokens=None still means "until the
context is full". The server's side is in test_server_hostile."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from tests.tiny_model import save_tiny_llama

MAX_MODEL_LEN = 64
PROMPT = list(range(10, 30))  # 20 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _assert_no_blocks_held(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("max_tokens", [MAX_MODEL_LEN - len(PROMPT) + 1, 10**12, 2**70])
def test_max_tokens_past_the_context_is_a_value_error_in_vllms_words(tiny, max_tokens):
    llm = LLM(model=tiny, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError) as error:
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    assert error.value.param == "max_tokens"
    assert str(error.value).startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{len(PROMPT) + max_tokens} tokens ({len(PROMPT)} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion"
    )
    assert f"max_tokens may be at most {MAX_MODEL_LEN - len(PROMPT)}" in str(error.value)
    _assert_no_blocks_held(llm)


def test_what_fits_and_max_tokens_none_run_to_the_end_of_the_context(tiny):
    llm = LLM(model=tiny, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    room = MAX_MODEL_LEN - len(PROMPT)
    exact, unbounded = llm.generate(
        prompt_token_ids=[PROMPT, PROMPT],
        sampling_params=[
            SamplingParams(max_tokens=room, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert len(exact.outputs[0].token_ids) == len(unbounded.outputs[0].token_ids) == room
    assert exact.outputs[0].finish_reason == unbounded.outputs[0].finish_reason == "length"
    _assert_no_blocks_held(llm)


def test_clamp_policy_generates_until_the_context_is_full(tiny):
    llm = LLM(model=tiny, num_kv_blocks=16, max_model_len=MAX_MODEL_LEN, max_tokens_policy="clamp")
    params = SamplingParams(max_tokens=10**12, temperature=0, ignore_eos=True)
    (output,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == MAX_MODEL_LEN - len(PROMPT)
    assert output.outputs[0].finish_reason == "length"
    _assert_no_blocks_held(llm)
