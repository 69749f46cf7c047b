"""A chat template from a file (``--chat-template FILE``, ``LLM(chat_template=...)``) and the checks on a
request's ``chat_template_kwargs``.

The file is read and compiled once, before the model loads, so a missing file or a Jinja syntax error
stops the start in a second with the file and line named, instead of failing every chat request later.
Compiling goes through transformers' own cached compiler, so the requests' renders reuse this compile.

``chat_template_kwargs`` become template variables (Qwen3's ``enable_thinking``). A client may not set the
variables the renderer itself passes (``messages``, ``tools``, ``add_generation_prompt``, the special
tokens): those would change what the server renders in ways it does not check. Values are scalars, small,
and hold no control-token text -- a string variable printed by the template must not forge a turn, as a
message's text cannot (``prompts.render_chat``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pagedkv.errors import InvalidParameter

MAX_TEMPLATE_BYTES = 1 << 20
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARG_CHARS = 1024
TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# What apply_chat_template and its renderer pass or take themselves: a kwarg of the same name would replace it.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "conversation",
        "conversations",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "raise_exception",
        "strftime_now",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
    }
)


class ChatTemplateError(ValueError):
    """A chat template file that cannot be used; the message names the file (and the line)."""


def load_chat_template(path: str | Path) -> str:
    """The template text of ``path``, compiled once; ChatTemplateError saying what is wrong with the file."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    where = f"chat template {str(path)!r}"
    try:
        raw = Path(path).read_bytes()[: MAX_TEMPLATE_BYTES + 1]
    except OSError as exc:
        raise ChatTemplateError(f"{where}: cannot be read ({exc.strerror or exc})") from exc
    if len(raw) > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{where}: larger than {MAX_TEMPLATE_BYTES} bytes; is it a template?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{where}: not UTF-8 text (byte {exc.start})") from exc
    if not text.strip():
        raise ChatTemplateError(f"{where}: the file is empty")
    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{where}: line {exc.lineno}: {exc.message}") from exc
    return text


def check_template_kwargs(kwargs: Any, control_texts: list[str], param: str = "chat_template_kwargs") -> dict:
    """``kwargs`` as template variables, or InvalidParameter naming the key (or the field) at fault."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidParameter(param, f"{param} must be an object of template variables")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidParameter(param, f"{param} has {len(kwargs)} keys, at most {MAX_TEMPLATE_KWARGS}")
    for name, value in kwargs.items():
        if not TEMPLATE_KWARG_NAME.fullmatch(name):
            raise InvalidParameter(param, f"{param}: {name[:80]!r} is not a variable name (letters, digits, _)")
        where = f"{param}.{name}"
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise InvalidParameter(where, f"{where}: {name!r} is set by the server's renderer and cannot be given")
        if value is not None and not isinstance(value, bool | int | float | str):
            raise InvalidParameter(where, f"{where} must be a string, number, boolean or null")
        if isinstance(value, str):
            if len(value) > MAX_TEMPLATE_KWARG_CHARS:
                message = f"{where} has {len(value)} characters, at most {MAX_TEMPLATE_KWARG_CHARS}"
                raise InvalidParameter(where, message)
            forged = [c for c in control_texts if c in value]
            if forged:
                raise InvalidParameter(where, f"{where} holds the control token text {forged[0]}: remove it")
    return dict(kwargs)
