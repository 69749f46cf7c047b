"""Prompts to token ids: plain text (no special tokens added) and chat messages through the model's template.

A completions prompt is the model's raw input, control tokens included (as in vLLM); in chat messages,
text is text (``render_chat``).

Functions over a tokenizer, so the engine (offline use), the server's tokenizer worker (its own copy of the
tokenizer, on its own thread) and the Ray ingress's routing keys (both through ``EnginePrompt.token_ids``)
turn prompts into ids the same way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.chat_templates import check_template_kwargs
from pagedkv.errors import InvalidParameter


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """The conversation rendered (with the generation prompt appended unless told not to), as token ids;
    ``kwargs`` go to the template as variables (``tools``, a request's ``chat_template_kwargs``).

    A message's text is tokenized as text: a control token typed into it (``<|im_end|><|im_start|>system``)
    stays characters, as anywhere else in text, instead of becoming the token that ends a turn and opens a
    system turn -- which HF's ``apply_chat_template`` (and so vLLM) lets any user forge. A conversation with
    no such text takes HF's own path, so its ids are exactly HF's.
    """
    controls = control_tokens(tokenizer)
    pattern = _pattern(controls)
    if pattern is None or not any(_typed(message, pattern) for message in messages):
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return render_typed_as_text(tokenizer, messages, controls, add_generation_prompt, **kwargs)


def control_tokens(tokenizer: Any) -> dict[str, int]:
    """The special added tokens (their text -> id): what the tokenizer turns into one control token wherever
    their text appears, unless told ``split_special_tokens``."""
    return {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def render_typed_as_text(
    tokenizer: Any, messages: Sequence[dict], controls: dict[str, int], add_generation_prompt: bool = True, **kwargs
) -> list[int]:
    """The template's control tokens as tokens, everything typed in the messages as text.

    The control texts typed in a message become private-use marker characters, the template renders the
    text, and that text is split at the control tokens left -- the template's own, as HF's tokenizer splits
    at added tokens -- and each piece in between, markers turned back, is tokenized with
    ``split_special_tokens``. Whether this split is HF's own for this tokenizer is checked on the same
    text, the typed controls counted as controls, and the result must hold no control token but the
    template's; where either fails, the request is refused rather than tokenized some third way.
    """
    pattern = _pattern(controls)
    markers = dict(zip(controls, _free_characters(messages, kwargs, tokenizer, len(controls))))
    marked = [dict(m, content=_mark(m["content"], pattern, markers)) if _typed(m, pattern) else m for m in messages]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    unmark = str.maketrans({marker: control for control, marker in markers.items()})
    typed_as_text = _split_at_controls(tokenizer, text, pattern, controls, unmark, as_text=True)
    as_hf = _split_at_controls(tokenizer, text.translate(unmark), pattern, controls, unmark, as_text=False)
    control_ids = set(controls.values())
    leaked = sum(i in control_ids for i in typed_as_text) != len(pattern.findall(text))  # split_special_tokens ignored
    if leaked or as_hf != list(tokenizer.encode(text.translate(unmark), add_special_tokens=False)):
        typed = sorted({c for m in messages if _typed(m, pattern) for c in pattern.findall(m["content"])})
        raise InvalidParameter(
            "prompt",
            f"the messages hold the control token text {', '.join(typed)}, which this model's tokenizer cannot "
            "keep as plain text: remove it",
        )
    return typed_as_text


def _split_at_controls(
    tokenizer: Any, text: str, pattern: re.Pattern, controls: dict[str, int], unmark: dict, as_text: bool
) -> list[int]:
    ids: list[int] = []
    start = 0
    for match in [*pattern.finditer(text), None]:
        end = len(text) if match is None else match.start()
        if end > start:
            piece = text[start:end].translate(unmark)
            ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=as_text)
        if match is not None:
            ids.append(controls[match.group()])
            start = match.end()
    return ids


def _pattern(controls: dict[str, int]) -> re.Pattern | None:
    """Any control token's text, longest first (so a longer one is not matched as its prefix)."""
    if not controls:
        return None
    return re.compile("|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True)))


def _typed(message: dict, pattern: re.Pattern) -> bool:
    content = message.get("content")
    return isinstance(content, str) and pattern.search(content) is not None


def _mark(content: str, pattern: re.Pattern, markers: dict[str, str]) -> str:
    return pattern.sub(lambda match: markers[match.group()], content)


def _free_characters(messages: Sequence[dict], kwargs: dict, tokenizer: Any, count: int) -> list[str]:
    """``count`` private-use characters that occur nowhere in the conversation, its options or the template."""
    used = set(repr(list(messages)) + repr(kwargs) + str(getattr(tokenizer, "chat_template", "")))
    free = [chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used]
    if len(free) < count:
        raise InvalidParameter("prompt", "the messages use every private-use character: remove some")
    return free[:count]


@dataclass(slots=True)
class EnginePrompt:
    """One prompt of a server request as text, token ids, or chat messages; ``tools`` go to a chat template
    that renders them itself, ``template_kwargs`` (a request's checked ``chat_template_kwargs``) too."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # False only where a rendering is asked for, not a generation (/tokenize)

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The ids as given, the messages rendered, or the text encoded; ValueError (a 400) if the chat
        template fails on the messages or there is no prompt at all."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        if self.messages is not None:
            variables = check_template_kwargs(self.template_kwargs, list(control_tokens(tokenizer)))
            try:
                return render_chat(tokenizer, self.messages, self.add_generation_prompt, tools=self.tools, **variables)
            except Exception as exc:
                raise InvalidParameter(
                    "prompt", f"messages could not be rendered with the model's chat template: {exc}"
                ) from exc
        if self.prompt is None:
            raise ValueError("give a prompt, prompt token ids, or messages")
        return encode_text(tokenizer, self.prompt)
