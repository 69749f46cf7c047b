"""Shared, session-scoped fixtures: the default model, ours and HF's, each loaded at most once per run.

HF's reference is loaded straight from the GGUF file by transformers (not from pagedkv's converted cache),
so it stays independent of our loader. Imports happen inside the fixtures, so test files that need no
model do not pay for importing transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

    from pagedkv.model.loader import LoadedModel


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from pagedkv.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path: str) -> torch.nn.Module:
    """HF transformers' fp32 model of the default GGUF (weights dequantized by transformers)."""
    import torch
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
def default_model() -> LoadedModel:
    """pagedkv's default model through its own loader: fp32, gather attention."""
    from pagedkv.model.loader import load_model

    return load_model(None, dtype="float32", attention_backend="gather")
