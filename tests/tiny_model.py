"""A tiny random Llama checkpoint on disk (HF safetensors + a word-level tokenizer), built in well under a
second: engine tests that need many configurations but not a real model's text run on it."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast


def save_tiny_llama(directory: Path, seed: int = 0, **config: object) -> Path:
    """Write a random Llama to ``directory``; ``config`` overrides the LlamaConfig defaults below.

    Weights are scaled up from the default init so the logits are far from uniform: greedy choices and
    logprobs then depend on every bit of the attention and MLP sums, which is what the tests compare.
    """
    settings = {
        "vocab_size": 512,
        "hidden_size": 256,  # 4 heads of 64: the compiled attention kernel's specialised head size
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 3,
    }
    settings.update(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(int(settings["vocab_size"]))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w3").save_pretrained(directory)
    return directory
