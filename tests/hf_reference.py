"""HF transformers as the reference for a tiny random model of any family: its logits and logprobs, the
teacher-forced check of an engine's greedy outputs against them, and the checkpoint on disk the engine loads.

Teacher-forced: HF scores each prompt plus our generated tokens in one forward pass, so every step of ours is
compared with HF's logprob at the same position, and each greedy token must be HF's argmax.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TOL = 1e-4
# The tiny random decoders' shape (a config class adds its family's own fields): small enough for a test,
# with grouped-query attention (4 query heads over 2 KV heads) and two layers, so layer-to-layer state is seen.
TINY_SHAPE = dict(
    hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def hf_logprobs(hf: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(hf, sequence).double(), dim=-1)


def check_against_hf(hf: torch.nn.Module, prompts: list[list[int]], outputs, tol: float = TOL) -> None:
    """Every generated token is HF's argmax and its logprob within ``tol`` of HF's (outputs need logprobs=1)."""
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        reference = hf_logprobs(hf, prompt + tokens)
        for step, token in enumerate(tokens):
            row = reference[len(prompt) + step - 1]
            assert token == row.argmax().item(), (step, token)
            assert abs(output.outputs[0].logprobs[step] - row[token].item()) <= tol


def save_with_word_tokenizer(hf: torch.nn.Module, directory: Path) -> str:
    """``hf`` saved as an HF directory with a word-level tokenizer (``w0`` .. ``w{vocab-1}``): what ``LLM`` loads."""
    hf.save_pretrained(directory)
    vocab = hf.config.vocab_size
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(directory)
    return str(directory)
