"""Tool calling on /v1/chat/completions: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

A model calls a tool by writing a structured answer that the server turns into ``message.tool_calls``. Two
formats, chosen by the model's chat template:

* **native** -- the template renders ``tools`` itself (Hermes / Qwen style templates do). The tools go to the
  template, and the model answers in the format it was trained on: ``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`` blocks, parsed out of its text. With ``tool_choice`` ``"required"`` or a named function
  the blocks are enforced by a grammar (a Lark grammar with the call's JSON schema inside), so the arguments
  always validate.
* **generic** -- the template knows nothing of tools (SmolLM2's does not). As llama.cpp's server does for
  such templates, the tools are described in the system message and the answer is constrained to one JSON
  object: ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, or with ``"auto"`` also
  ``{"response": "..."}`` for a plain answer. Every call's arguments validate against its function's schema.

``tool_choice: "none"`` leaves tools out of the prompt and the answer unconstrained. Tool results (``tool``
messages) and earlier calls (assistant messages with ``tool_calls``) go back into the prompt in the same
format the model answers in.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.prompts import EnginePrompt
from pagedkv.entrypoints.server.openai_objects import FunctionCall, ToolCallResponse
from pagedkv.entrypoints.server.protocol import APIError, ChatMessage, echoed
from pagedkv.structured import StructuredOutputsParams, lark_json

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NATIVE_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """OpenAI's tool object, as chat templates and the generic system message show it."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def call_schema(self) -> dict[str, Any]:
        """One call of this function: its name, and arguments valid under its parameter schema."""
        return _object({"name": {"const": self.name}, "arguments": self.parameters})


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one request's tools ask of the prompt, of the output grammar and of the answer's parsing."""

    functions: tuple[Function, ...]  # the ones the model may call
    offered: tuple[Function, ...]  # the ones it is told about (all of them, also with a named choice)
    choice: str  # "auto", "required" or a function name
    parallel: bool
    native: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar the answer must follow (None: native and "auto", the model's own format, parsed)."""
        schemas = [f.call_schema() for f in self.functions]
        call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if self.native:
            if not self.forced:
                return None
            block = f'"<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {lark_json(call)}'
            return StructuredOutputsParams(grammar=f"start: block{'+' if self.parallel else ''}\nblock: {block}")
        calls = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        answer = _object({"tool_calls": calls})
        if not self.forced:
            answer = {"anyOf": [answer, _object({"response": {"type": "string"}})]}
        return StructuredOutputsParams(json=answer)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [f.as_tool() for f in self.offered] if self.native else None

    def system_instructions(self) -> str | None:
        """For the generic format: the tools and the answer format, to put in the system message."""
        if self.native:
            return None
        tools = json.dumps([f.as_tool() for f in self.offered], ensure_ascii=False)
        call = '{"tool_calls": [{"name": <function name>, "arguments": <arguments object>}]}'
        if self.choice == "auto":
            how = f'Answer with one JSON object: {call} to call functions, or {{"response": <text>}} to reply.'
        elif self.choice == "required":
            how = f"Answer by calling functions, as one JSON object: {call}."
        else:
            how = f"Answer by calling the function {self.choice}, as one JSON object: {call}."
        if not self.parallel:
            how += " Call one function at a time."
        return f"You can call these functions:\n{tools}\n{how}"

    def parse(self, text: str) -> tuple[str | None, list[ToolCallResponse]]:
        """(content, tool calls) of a finished answer; an answer that does not parse (cut by max_tokens, or
        a native "auto" answer without calls) is plain content."""
        if self.native:
            calls = [_call(block) for block in NATIVE_CALL.findall(text)]
            if not calls or None in calls:
                return text, []
            content = NATIVE_CALL.sub("", text).strip()
            return content or None, calls
        try:
            answer = json.loads(text)
        except ValueError:
            return text, []
        if isinstance(answer, dict) and isinstance(answer.get("response"), str):
            return answer["response"], []
        calls = [_call(c) for c in answer.get("tool_calls", [])] if isinstance(answer, dict) else []
        if not calls or None in calls:
            return text, []
        return None, calls


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, native: bool) -> ToolPlan | None:
    """The request's tool plan, or None when it asks for no tool calls; APIError (400) naming the field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools: give the functions the model may call", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
    offered = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [f.name for f in offered]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    choice = "auto" if tool_choice is None else _choice(tool_choice, names)
    if choice == "none":
        return None
    if not isinstance(parallel_tool_calls, bool | None):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    functions = tuple(f for f in offered if f.name == choice) or offered
    return ToolPlan(functions, offered, choice, parallel_tool_calls is not False, native)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders a ``tools`` variable (HF templates that support tool use do)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def _function(tool: Any, index: int) -> Function:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise APIError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
    name, parameters = function.get("name"), function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", param=where)
    if not isinstance(parameters, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema object", param=where)
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise APIError(400, f"{where}.function.description must be a string", param=where)
    return Function(name, description, parameters)


def _choice(tool_choice: Any, names: list[str]) -> str:
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise APIError(400, f"tool_choice names {echoed(name)}, which is not one of the tools", param="tool_choice")
    return name


def chat_prompt(messages: list[ChatMessage], plan: ToolPlan | None, native: bool) -> EnginePrompt:
    """The conversation for the chat template: earlier calls and tool results in the format the model
    answers in; the tools go to a native template, or for the generic format, with the answer format, into
    the system message."""
    flat = [m.as_template_dict(i) for i, m in enumerate(messages)]
    rendered = [_message_for_prompt(m, i, native) for i, m in enumerate(flat)]
    instructions = plan.system_instructions() if plan is not None else None
    if instructions is not None and rendered and rendered[0]["role"] == "system":
        rendered = [dict(rendered[0], content=f"{rendered[0]['content']}\n\n{instructions}"), *rendered[1:]]
    elif instructions is not None:
        rendered = [{"role": "system", "content": instructions}, *rendered]
    return EnginePrompt(messages=rendered, tools=plan.template_tools() if plan is not None else None)


def _message_for_prompt(message: dict[str, Any], index: int, native: bool) -> dict[str, Any]:
    """An assistant message's calls and a tool message's result, as the template (native) or the generic
    format (the JSON the model would have written; the result wrapped with its call's id) expects them."""
    calls = message.get("tool_calls")
    if calls is not None and message["role"] == "assistant":
        if not isinstance(calls, list):
            raise APIError(400, f"messages[{index}].tool_calls must be a list", param=f"messages[{index}].tool_calls")
        calls = [_earlier_call(c, f"messages[{index}].tool_calls[{i}]") for i, c in enumerate(calls)]
        if native:
            rendered = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
            return {"role": "assistant", "content": message["content"], "tool_calls": rendered}
        answer = {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}
        return {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)}
    if message["role"] == "tool":
        call_id = message.get("tool_call_id")
        if native:
            return {"role": "tool", "content": message["content"], "tool_call_id": call_id}
        result = {"tool_response": {"tool_call_id": call_id, "content": message["content"]}}
        return {"role": "tool", "content": json.dumps(result, ensure_ascii=False)}
    return {"role": message["role"], "content": message["content"]}


def _earlier_call(call: Any, where: str) -> tuple[str, Any]:
    """(name, parsed arguments) of a call the client sends back in an assistant message."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise APIError(400, f"{where} must be {{'function': {{'name': str, 'arguments': str}}}}", param=where)
    try:
        return name, json.loads(arguments)
    except ValueError as exc:
        raise APIError(400, f"{where}.function.arguments is not JSON: {exc}", param=where) from exc


def _call(value: Any) -> ToolCallResponse | None:
    """A parsed call object -- or its JSON text -- as the response's tool call; None if it is not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    function = FunctionCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))
    return ToolCallResponse(id=f"call_{uuid.uuid4().hex[:24]}", function=function)


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
