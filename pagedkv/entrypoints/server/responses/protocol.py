"""The request of ``POST /v1/responses`` (OpenAI's Responses API), in the terms /v1/chat/completions runs.

A Responses request is a chat request in other words: ``input`` (a string, or a list of items: messages,
earlier function calls and their outputs), ``instructions`` (a system message that a continuation does not
inherit), ``max_output_tokens``, ``text.format`` (a JSON schema or any JSON object) and flat function
``tools``. This module turns it into chat messages, the chat tool format and a grammar, so both routes
render the same prompt for the same conversation and give the same greedy answer.

Whatever the server does not do is a 400 naming the field, never silently ignored: built-in tools
(``web_search``, ``file_search``, ...), image, file and audio inputs, ``reasoning``, ``background``, and any
field this module does not know (as OpenAI answers an unknown parameter). A few fields are accepted at the
value that asks for nothing (``truncation: "disabled"``, ``include: []``, ``background: false``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, field_validator

from pagedkv.entrypoints.server.protocol import APIError, echoed, sampling_params
from pagedkv.entrypoints.server.tool_calls import NAME
from pagedkv.sampling_params import SamplingParams
from pagedkv.structured import StructuredOutputsParams

# Fields OpenAI defines that this server accepts only at the value that changes nothing.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "truncation": ("disabled",),
    "include": ([],),
    "service_tier": ("auto", "default"),
    "top_logprobs": (0,),
    "stream_options": ({},),
}
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``; types strict, as the chat route's (``protocol``) are."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool = True
    user: str | None = None
    previous_response_id: str | None = None
    stream: StrictBool = False
    cache_salt: str | None = None  # vLLM's extension, as on the chat route: tenants that share no prefix blocks

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        """One error naming ``input``, not one per member of the union."""
        if not isinstance(value, str | list):
            raise ValueError("input must be a string or a list of input items")
        return value

    def check_supported(self) -> None:
        """A 400 naming the first field this server does not honour; metadata within OpenAI's bounds."""
        for name, value in (self.model_extra or {}).items():
            if value is None or any(_same(value, allowed) for allowed in NO_OP_VALUES.get(name, ())):
                continue
            raise APIError(
                400, f"{name} is not supported by this server: remove it", param=name, code="unsupported_parameter"
            )
        if self.metadata is not None:
            _check_metadata(self.metadata)

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (role, content, tool_calls, tool_call_id); ``instructions`` not included,
        nor reasoning items (stored conversations keep no thinking either)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for index, item in enumerate(self.input):
            if isinstance(item, dict) and item.get("type") == "reasoning":
                continue  # an earlier answer's thinking, sent back with it: a template shows no past thinking
            message = _item_message(item, f"input[{index}]")
            previous = messages[-1] if messages else None
            if message.get("tool_calls") and previous is not None and previous["role"] == "assistant":
                # one assistant turn: its text (if any) and every function it called
                previous["tool_calls"] = (previous.get("tool_calls") or []) + message["tool_calls"]
            else:
                messages.append(message)
        return messages

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the chat route's shape; any other kind of tool is a 400 naming it."""
        if self.tools is None:
            return None
        return [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(self.tools)]

    def chat_tool_choice(self) -> Any:
        """``tool_choice`` in the chat route's shape: ``{"type": "function", "name": ...}`` gets nested."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        kind = choice.get("type") if isinstance(choice, dict) else None
        raise APIError(
            400,
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}; '
            f"got type {echoed(kind)}, which this server does not support",
            param="tool_choice",
        )

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar ``text.format`` asks for: none for ``text``, any object, or a JSON schema."""
        text = self.text or {}
        for name, value in text.items():
            if name not in ("format", "verbosity") or (name == "verbosity" and value is not None):
                raise APIError(400, f"text.{name} is not supported by this server: remove it", param=f"text.{name}")
        spec = text.get("format")
        kind = spec.get("type") if isinstance(spec, dict) else None
        if spec is None or kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            if not isinstance(spec.get("schema"), dict):
                raise APIError(400, "text.format.schema must be a JSON schema object", param="text.format.schema")
            return StructuredOutputsParams(json=spec["schema"])
        raise APIError(400, "text.format.type must be 'text', 'json_object' or 'json_schema'", param="text.format.type")

    def to_sampling_params(self, tool_grammar: StructuredOutputsParams | None) -> SamplingParams:
        """``tool_grammar``: the answer format tool calling asks for; it excludes a ``text.format`` grammar."""
        if self.max_output_tokens == 0:
            raise APIError(400, "max_output_tokens must be >= 1", param="max_output_tokens")
        structured = self.structured_outputs()
        if tool_grammar is not None and structured is not None:
            raise APIError(400, "tools and a text.format cannot be combined: drop one", param="tools")
        kwargs: dict[str, Any] = {"max_tokens": self.max_output_tokens, "n": 1}
        kwargs |= {name: getattr(self, name) for name in ("temperature", "top_p") if getattr(self, name) is not None}
        if tool_grammar or structured:
            kwargs["structured_outputs"] = tool_grammar or structured
        return sampling_params(kwargs, self.param_renames(tool_grammar is not None))

    def param_renames(self, tools: bool) -> dict[str, str]:
        """The engine's names of parameters, as this request called them (its errors must name those)."""
        return {"max_tokens": "max_output_tokens", "structured_outputs": "tools" if tools else "text.format"}


def _same(value: Any, allowed: Any) -> bool:
    """Equal and of the same type: ``0`` is not ``false``, nor ``1.0`` an integer."""
    return type(value) is type(allowed) and value == allowed


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_KEYS:
        raise APIError(400, f"metadata has {len(metadata)} keys, at most {MAX_METADATA_KEYS}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(
                400,
                f"metadata keys may have {MAX_METADATA_KEY_CHARS} characters and values {MAX_METADATA_VALUE_CHARS}: "
                f"{echoed(key)} is longer",
                param="metadata",
            )


def _item_message(item: Any, where: str) -> dict[str, Any]:
    """One input item as a chat message: a message, an earlier function call, or a function's output."""
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object (a message or a function call item)", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=f"{where}.role")
        return {"role": role, "content": _text(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        name, arguments, call_id = (_string(item, key, where) for key in ("name", "arguments", "call_id"))
        if not NAME.fullmatch(name):
            raise APIError(400, f"{where}.name must be 1-64 letters, digits, '_', '.' or '-'", param=f"{where}.name")
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise APIError(400, f"{where}.arguments is not JSON: {exc}", param=f"{where}.arguments") from exc
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        return {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}
    raise APIError(
        400,
        f"{where}: {echoed(kind)} items are not supported by this server "
        "(only messages, function_call, function_call_output and reasoning)",
        param=f"{where}.type",
    )


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (images, files and audio are a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of input_text parts", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}[{index}]: only text parts (input_text, output_text) are supported, got type {echoed(kind)}",
                param=f"{where}[{index}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """``{"type": "function", "name", "description", "parameters", "strict"}`` as the chat route's tool."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise APIError(
            400,
            f"{where}: {echoed(kind)} tools are not supported by this server (only function tools)",
            param=f"{where}.type",
        )
    name, description = tool.get("name"), tool.get("description") or ""
    parameters = tool.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise APIError(400, f"{where}.name must be 1-64 letters, digits, '_', '.' or '-'", param=f"{where}.name")
    if not isinstance(parameters, dict):
        raise APIError(400, f"{where}.parameters must be a JSON schema object", param=f"{where}.parameters")
    if not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string", param=f"{where}.description")
    for key in tool:
        if key not in ("type", "name", "description", "parameters", "strict"):
            raise APIError(400, f"{where}.{key} is not supported by this server: remove it", param=f"{where}.{key}")
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
