"""Request bodies of Ollama's API (``/api/chat``, ``/api/generate``, ``/api/show``) and how they map onto pagedkv.

Ollama's ``options`` become ``SamplingParams`` here, in one table (``SAMPLING_OPTIONS``); an option pagedkv
cannot honour is a 400 that names it, never a silently different answer. A few options are accepted only
at the value that switches them off (``mirostat: 0``), so a client that sends its defaults still works.
Where Ollama and pagedkv differ in meaning, the difference is refused or documented (docs/server-ollama.md):
``repeat_penalty`` covers the whole context (Ollama's ``repeat_last_n: -1``), and ``num_ctx`` is checked
against the server's context rather than resizing it (every request may use all of it).

A field Ollama's API does not have is refused by name too (Ollama ignores it), as on the /v1 routes.

Errors on ``/api/*`` routes have Ollama's shape, ``{"error": "message"}``, naming the field in the message
since Ollama's body has no separate ``param``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from pagedkv.engine.prompts import EnginePrompt
from pagedkv.entrypoints.server.ollama.tools import chat_message
from pagedkv.entrypoints.server.protocol import MAX_ECHOED_CHARS, APIError, ChatMessage, echoed, sampling_params
from pagedkv.entrypoints.server.tool_calls import ToolPlan, chat_prompt, plan_tools
from pagedkv.sampling_params import SamplingParams
from pagedkv.structured import StructuredOutputsParams

OLLAMA_PREFIX = "/api/"
# Ollama option -> SamplingParams field, for the options whose meaning is the same in both.
SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repetition_penalty",
    "num_predict": "max_tokens",
}
# Options accepted only at the value that turns them off: a client sending Ollama's defaults still works.
NEUTRAL_OPTIONS: dict[str, Any] = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0, "repeat_last_n": -1}
# Ollama's defaults for the sampling options a request leaves out (its Modelfile defaults), so that a client
# gets the behaviour it was written against; pagedkv applies no repeat penalty unless asked (see the docs).
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
INTEGER_OPTIONS = ("top_k", "seed", "num_predict", "num_ctx", "repeat_last_n", "mirostat")
UNLIMITED_PREDICT = (-1, -2)  # Ollama: -1 generate until done, -2 until the context is full
# SamplingParams field -> the request's name for it, so engine refusals name what the client wrote.
RENAMES = {param: f"options.{option}" for option, param in SAMPLING_OPTIONS.items()} | {
    "structured_outputs": "format",
    "logprobs": "top_logprobs",  # the engine's count of alternatives is Ollama's top_logprobs
}


def ollama_error_body(error: APIError) -> dict[str, str]:
    """Ollama's error body: one message, which names the field at fault (Ollama's body has no ``param``)."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"error": message}


def is_ollama_path(path: str) -> bool:
    return path.startswith(OLLAMA_PREFIX)


def refuse_unknown(model: BaseModel, where: str) -> None:
    """A 400 for the first field the request model does not declare: as on the /v1 routes, a misspelt option
    must not pass for one that was honoured (Ollama itself ignores unknown fields)."""
    name = next(iter(model.model_extra or {}), None)
    if name is not None:
        param = f"{where}.{name[:MAX_ECHOED_CHARS]}".lstrip(".")
        raise APIError(400, f"{echoed(name)} is not a field this server knows: remove it", param=param)


def _refuse_set(request: BaseModel, names: tuple[str, ...], why: str, where: str = "") -> None:
    """A 400 for the first of ``names`` set to anything but its empty or false value (``where``: the request
    model's path in the body, ``messages[2].``)."""
    for name in names:
        if getattr(request, name) not in (None, False, "", [], {}):
            raise APIError(400, f"{where}{name} is not supported by this server ({why}): remove it", param=where + name)


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: Any = None
    thinking: Any = None
    tool_calls: Any = None
    tool_name: Any = None

    def as_chat_message(self, index: int) -> ChatMessage:
        refuse_unknown(self, f"messages[{index}]")
        _refuse_set(self, ("images",), "text only", f"messages[{index}].")
        _refuse_set(self, ("thinking",), "no reasoning output", f"messages[{index}].")
        return chat_message(self.role, self.content, self.tool_calls, self.tool_name, index)


class _OllamaGenerationRequest(BaseModel):
    """What /api/chat and /api/generate share: the model, options, format, streaming and the refused extras."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    options: dict[str, Any] | None = None
    format: Any = None
    stream: StrictBool = True  # Ollama streams unless told not to
    keep_alive: str | float | None = None  # accepted and ignored: the model is always loaded
    think: Any = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    def check_supported(self) -> None:
        refuse_unknown(self, "")
        _refuse_set(self, ("think",), "this model has no reasoning output")

    def tool_plan(self, native: bool) -> ToolPlan | None:
        """The tools the model may call (None: none offered; only /api/chat has tools)."""
        return None

    def sampling_params(self, max_model_len: int, tool_grammar: StructuredOutputsParams | None) -> SamplingParams:
        """``tool_grammar``: the answer format that the request's tools ask for (no ``format`` with it)."""
        kwargs = dict(OLLAMA_DEFAULTS)
        for name, value in (self.options or {}).items():
            kwargs |= _option(name, value, max_model_len)
        if "max_tokens" not in kwargs:
            kwargs["max_tokens"] = None  # Ollama's default num_predict: until the model stops or the context fills
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        grammar = self.structured_outputs()
        if grammar is not None and tool_grammar is not None:
            raise APIError(400, "tools and format cannot be combined: drop one", param="tools")
        chosen = grammar if grammar is not None else tool_grammar
        if chosen is not None:
            kwargs["structured_outputs"] = chosen
        return sampling_params(kwargs, self.renames(tool_grammar))

    @staticmethod
    def renames(tool_grammar: StructuredOutputsParams | None) -> dict[str, str]:
        """The request's names of the engine's parameters, for refusals: a grammar is ``format`` or ``tools``."""
        return RENAMES | ({"structured_outputs": "tools"} if tool_grammar is not None else {})

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """``format``: ``"json"`` (any JSON object) or a JSON schema, both through the structured-output engine."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return StructuredOutputsParams(json_object=True)
        if isinstance(self.format, dict):
            return StructuredOutputsParams(json=self.format)
        raise APIError(400, f'format must be "json" or a JSON schema object, got {echoed(self.format)}', param="format")


def _option(name: str, value: Any, max_model_len: int) -> dict[str, Any]:
    """The SamplingParams arguments of one Ollama option (none for a neutral one); a 400 for the rest."""
    param = f"options.{name[:MAX_ECHOED_CHARS]}"  # the name is the client's: a 1 MiB key is not echoed whole
    if name in INTEGER_OPTIONS and (not isinstance(value, int) or isinstance(value, bool)):
        raise APIError(400, f"{param} must be an integer, got {echoed(value)}", param=param)
    if name == "num_ctx":
        if not 0 < value <= max_model_len:
            raise APIError(
                400,
                f"{param} is {value} but this server's context is {max_model_len} tokens (--max-model-len); every "
                "request may use all of it",
                param=param,
            )
        return {}
    if name in NEUTRAL_OPTIONS:
        if value != NEUTRAL_OPTIONS[name]:
            raise APIError(
                400,
                f"{param} is not supported by this server: remove it or set it to {NEUTRAL_OPTIONS[name]}",
                param=param,
            )
        return {}
    if name not in SAMPLING_OPTIONS:
        supported = ", ".join(sorted([*SAMPLING_OPTIONS, "num_ctx", *NEUTRAL_OPTIONS]))
        raise APIError(400, f"{param} is not supported by this server (supported: {supported})", param=param)
    if name == "num_predict":
        if value in UNLIMITED_PREDICT:
            return {"max_tokens": None}
        if value < 0:
            raise APIError(400, f"{param} must be >= 0, -1 or -2, got {value}", param=param)
    if name == "stop" and isinstance(value, str):
        value = [value]
    if name == "stop" and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise APIError(400, f"{param} must be a list of strings", param=param)
    return {SAMPLING_OPTIONS[name]: value}


class OllamaChatRequest(_OllamaGenerationRequest):
    prompt_param: ClassVar[str] = "messages"  # the field that engine refusals of the prompt name

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: Any = None

    def tool_plan(self, native: bool) -> ToolPlan | None:
        """Ollama has no tool_choice: the model may call any tool or reply ("auto")."""
        return plan_tools(self.tools, None, None, native)

    def engine_prompt(self, tools: ToolPlan | None, native: bool) -> EnginePrompt | None:
        """The conversation (with the tools) for the chat template; None for no messages (Ollama's request to
        load the model)."""
        if not self.messages:
            return None
        return chat_prompt([m.as_chat_message(i) for i, m in enumerate(self.messages)], tools, native)


class OllamaGenerateRequest(_OllamaGenerationRequest):
    prompt_param: ClassVar[str] = "prompt"

    prompt: str = ""
    system: str | None = None
    raw: StrictBool = False
    suffix: Any = None
    template: Any = None
    context: Any = None
    images: Any = None
    width: Any = None
    height: Any = None
    steps: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        _refuse_set(
            self,
            ("template",),
            "prompts use the model's own chat template; send raw=true with a prompt you formatted yourself",
        )
        _refuse_set(self, ("suffix",), "no fill-in-the-middle")
        _refuse_set(self, ("context",), "send the conversation to /api/chat instead")
        _refuse_set(self, ("images", "width", "height", "steps"), "text only")
        if self.raw and self.system:
            raise APIError(400, "system cannot be combined with raw=true: put it in the prompt", param="system")

    def engine_prompt(self, tools: None, native: bool) -> EnginePrompt | None:
        """``raw``: the prompt as given; else one user turn after the optional system message, as Ollama's
        templates render it. None for an empty prompt (Ollama's request to load the model)."""
        if not self.prompt:
            return None
        if self.raw:
            return EnginePrompt(prompt=self.prompt)
        system = [{"role": "system", "content": self.system}] if self.system else []
        return EnginePrompt(messages=[*system, {"role": "user", "content": self.prompt}])


class OllamaShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    verbose: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _older_name(cls, body: Any) -> Any:
        """Older Ollama clients name the model ``name`` here."""
        if isinstance(body, dict) and "model" not in body and "name" in body:
            return {**body, "model": body["name"]}
        return body
