"""Prompts to token ids: plain text (no special tokens added) and chat messages through the model's template.

Free functions over a tokenizer, so the engine (offline use) and the server's tokenizer worker (its own copy
of the tokenizer, on its own thread) turn prompts into ids the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat(tokenizer: Any, messages: Sequence[dict], **kwargs) -> list[int]:
    """The conversation rendered with the generation prompt appended, as token ids."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
