"""Request fields the server does not act on: each is a 400 naming it, unless it asks for nothing.

A client that sets ``reasoning_effort``, ``logit_bias`` or vLLM's ``use_beam_search`` expects an effect; an
answer that silently lacks it is a plausible wrong answer. So every field of a request body is either read
by the server, or known and accepted only at the value that asks for nothing (``store: false``,
``service_tier: "auto"``, ``modalities: ["text"]`` -- what clients send by default), or refused by name.
A field the server does not know at all is refused too (as OpenAI's API does), so a misspelt option is
not mistaken for one that was honoured.
"""

from __future__ import annotations

from typing import Any

MAX_QUOTED = 100
# Fields with no effect whatever their value: who the end user is, labels for stored completions.
NO_EFFECT = frozenset({"user", "metadata"})
# Fields accepted at the values that ask for what the server does anyway, and null; those with no such
# value listed also when unset as everywhere (false, [] or {}); any other value is refused.
DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "store": (),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "prompt_cache_key": (),
    "safety_identifier": (),
    "add_generation_prompt": (True,),
    "continue_final_message": (),
    "add_special_tokens": (),
    "use_beam_search": (),
    "length_penalty": (1, 1.0),
    "priority": (0,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (),
    "chat_template": (),
    "documents": (),
    "tools": (),  # /tokenize (the chat route reads its tools)
    "mm_processor_kwargs": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "request_id": (),
}
WHY = {
    "chat_template": "give the template at server start with --chat-template FILE",
    "reasoning_effort": "a thinking model's effort is a chat_template_kwargs variable where its template reads one",
}


def unhonoured_field(extra: dict[str, Any], read: frozenset[str]) -> tuple[str, str] | None:
    """(name, message) of the first field of ``extra`` (the body's fields the request model does not
    declare) that the server neither reads (``read``) nor accepts at the value given; None if there is none."""
    for name, value in extra.items():
        if name in read or name in NO_EFFECT:
            continue
        defaults = DEFAULT_ONLY.get(name)
        unset = value is None or (not defaults and (value is False or value == [] or value == {}))
        if defaults is not None and (unset or value in defaults):
            continue
        if name in DEFAULT_ONLY:
            return name, f"{name}={_quoted(value)} is not supported by this server: {WHY.get(name, 'remove it')}"
        return name[:MAX_QUOTED], f"{_quoted(name)} is not a request field this server knows: remove it"
    return None


def _quoted(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_QUOTED else f"{text[:MAX_QUOTED]}..."
