"""Prompts to token ids: plain text (no special tokens added) and chat messages through the model's template.

Functions over a tokenizer, so the engine (offline use), the server's tokenizer worker (its own copy of the
tokenizer, on its own thread) and the Ray ingress's routing keys (both through ``EnginePrompt.token_ids``)
turn prompts into ids the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat(tokenizer: Any, messages: Sequence[dict], **kwargs) -> list[int]:
    """The conversation rendered with the generation prompt appended, as token ids."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@dataclass(slots=True)
class EnginePrompt:
    """One prompt of a server request as text, token ids, or chat messages; ``tools`` go to a chat template
    that renders them itself."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The ids as given, the messages rendered, or the text encoded; ValueError (a 400) if the chat
        template fails on the messages or there is no prompt at all."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        if self.messages is not None:
            try:
                return render_chat(tokenizer, self.messages, tools=self.tools)
            except Exception as exc:
                raise ValueError(f"messages could not be rendered with the model's chat template: {exc}") from exc
        if self.prompt is None:
            raise ValueError("give a prompt, prompt token ids, or messages")
        return encode_text(tokenizer, self.prompt)
