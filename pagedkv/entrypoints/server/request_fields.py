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

from pagedkv.entrypoints.server.protocol import MAX_ECHOED_CHARS, APIError, echoed

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
    # OpenAI's and vLLM's sampling fields that pagedkv does not implement
    "functions": (),
    "function_call": (),
    "logit_bias": (),
    "suffix": (),
    "best_of": (1,),
    "audio": (),
    "prediction": (),
    "allowed_token_ids": (),
    "bad_words": (),
    "logits_processors": (),
    "truncate_prompt_tokens": (),
}
WHY = {
    "chat_template": "give the template at server start with --chat-template FILE",
    "reasoning_effort": "a thinking model's effort is a chat_template_kwargs variable where its template reads one",
}


def refuse_unhonoured(extra: dict[str, Any], read: frozenset[str]) -> None:
    """A 400 naming the first field of ``extra`` (the body's fields the request model does not declare) that
    the server neither reads (``read``) nor accepts at the value given."""
    for name, value in extra.items():
        if name in read or name in NO_EFFECT:
            continue
        defaults = DEFAULT_ONLY.get(name)
        unset = value is None or (not defaults and (value is False or value == [] or value == {}))
        if defaults is not None and (unset or value in defaults):
            continue
        if name in DEFAULT_ONLY:
            message = f"{name}={echoed(value)} is not supported by this server: {WHY.get(name, 'remove it')}"
            raise APIError(400, message, param=name, code="unsupported_parameter")
        message = f"{echoed(name)} is not a request field this server knows: remove it"
        raise APIError(400, message, param=name[:MAX_ECHOED_CHARS], code="unsupported_parameter")
