"""Tool calling on /api/chat: Ollama's ``tools`` and tool messages, through the /v1 route's tool machinery.

Ollama's tools are OpenAI's function tools, so ``tool_calls.plan_tools`` plans them as for "auto" (Ollama
has no ``tool_choice``): a model whose template renders tools gets them and answers in its own format, any
other gets them in the system message and an answer constrained to calls or a reply (see ``tool_calls``).
Only the shapes differ: Ollama's calls carry ``arguments`` as a JSON object, not as JSON text, and a tool
result names its tool (``tool_name``) rather than a call id.
"""

from __future__ import annotations

import json
from typing import Any

from pagedkv.entrypoints.server.openai_objects import ToolCallResponse
from pagedkv.entrypoints.server.protocol import APIError, ChatMessage


def openai_call(call: Any, where: str) -> dict[str, Any]:
    """An earlier call sent back in an assistant message, ``{"function": {"name", "arguments": {...}}}``,
    in the /v1 shape that ``tool_calls.chat_prompt`` renders (arguments as JSON text)."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise APIError(400, f"{where} must be {{'function': {{'name': str, 'arguments': object}}}}", param=where)
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def chat_message(role: str, content: str, tool_calls: Any, tool_name: Any, index: int) -> ChatMessage:
    """One Ollama message as the /v1 route's ChatMessage; a tool result's ``tool_name`` stands in for the call
    id the /v1 shape has (Ollama's messages have none)."""
    extra: dict[str, Any] = {}
    if tool_calls not in (None, []):
        where = f"messages[{index}].tool_calls"
        if role != "assistant" or not isinstance(tool_calls, list):
            raise APIError(400, f"{where} must be a list, on an assistant message", param=where)
        extra["tool_calls"] = [openai_call(c, f"{where}[{i}]") for i, c in enumerate(tool_calls)]
    if role == "tool":
        if tool_name is not None and not isinstance(tool_name, str):
            raise APIError(400, "tool_name must be a string", param=f"messages[{index}].tool_name")
        extra["tool_call_id"] = tool_name
    return ChatMessage(role=role, content=content, **extra)


def ollama_tool_calls(calls: list[ToolCallResponse]) -> list[dict[str, Any]]:
    """Parsed calls in Ollama's shape: the arguments as an object."""
    return [{"function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in calls]
