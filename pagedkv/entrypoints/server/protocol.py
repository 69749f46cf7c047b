"""What every API's request bodies share: OpenAI-style errors (:class:`APIError`, also what the Ollama and Responses
APIs raise), the quoting of a client's value in a message, a chat message, the prompt union's shape check, and
``SamplingParams`` built with its errors turned into a 400 naming the request's field. The OpenAI API's own two
requests: ``openai_requests``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pagedkv.sampling_params import SamplingParams

MAX_ECHOED_CHARS = 100


def echoed(value: Any) -> str:
    """A client's value as an error message may quote it: its repr, cut to ``MAX_ECHOED_CHARS``. Enough to
    recognise it; a 1 MiB model name must not come back as a 1 MiB error (nor fill the server's log)."""
    text = repr(value)
    return text if len(text) <= MAX_ECHOED_CHARS else f"{text[:MAX_ECHOED_CHARS]}... ({len(text)} characters)"


class APIError(Exception):
    """An error with an HTTP status and the OpenAI error body ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After with 429 / 503

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def prompt_shape(value: Any, name: str) -> Any:
    """Check a prompt union's shape (text, texts, token ids, lists of token ids) in one pass: a list of 100 k
    bad items is one error, not 300 k."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(p, str) for p in value) or all(_is_int(t) for t in value):
            return value
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in value):
            return value
    raise ValueError(f"{name} must be a string, a list of strings, a list of token ids or a list of those")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_dict(self, index: int) -> dict[str, Any]:
        """Flatten text content parts (the chat template only knows plain strings); an assistant's
        ``tool_calls`` and a tool result's ``tool_call_id`` ride along (see ``tool_calls.chat_prompt``)."""
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"messages[{index}].content: only text parts are supported, "
                        f"got type {echoed(part.get('type'))}",
                        param=f"messages[{index}].content",
                    )
                parts.append(part["text"])
            text = "".join(parts)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        extra = self.model_extra or {}
        for name in ("tool_calls", "tool_call_id"):
            if extra.get(name) is not None:
                message[name] = extra[name]
        return message


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_params(kwargs: dict[str, Any], renames: dict[str, str] | None = None) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise value_error(exc, renames) from exc


def spec_message(field: str, message: str) -> str:
    """A structured-output error says which kind of spec failed (``structured_outputs.regex ...``); when the
    request gave it under another name (``guided_regex``, ``response_format``, ``tools``), it names that too."""
    if field != "structured_outputs" and message.startswith("structured_outputs"):
        return f"{field}: {message}"
    return message


def value_error(exc: ValueError, renames: dict[str, str] | None = None, prompt_param: str = "prompt") -> APIError:
    """Turn a SamplingParams / engine ValueError into a 400 that names the request field at fault.

    ``InvalidParameter.param`` names it; ``renames`` maps it to this endpoint's name for the field (chat's
    ``max_completion_tokens``), and the engine's "prompt" is the chat endpoint's ``messages``.
    """
    param = getattr(exc, "param", None)
    message = str(exc)
    if param == "prompt":
        param = prompt_param
    elif param is not None:
        renamed = (renames or {}).get(param, param)
        if param == "structured_outputs":
            message = spec_message(renamed, message)
        param = renamed
    return APIError(400, message, param=param)
