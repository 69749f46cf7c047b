"""Shared, session-scoped fixtures: the default model, ours and HF's, each loaded at most once per run.

HF's reference is loaded straight from the GGUF file by transformers (not from pagedkv's converted cache),
so it stays independent of our loader.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.model import loader


@pytest.fixture(scope="session")
def default_model_path() -> str:
    return loader.default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path: str) -> torch.nn.Module:
    """HF transformers' fp32 model of the default GGUF (weights dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model_path: str):
    from transformers import AutoTokenizer

    path = Path(default_model_path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def default_model() -> loader.LoadedModel:
    """pagedkv's default model through its own loader: fp32, gather attention."""
    return loader.load_model(None, dtype="float32", attention_backend="gather")
