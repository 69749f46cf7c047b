"""The OpenAI API's two sampling requests, ``/v1/completions`` and ``/v1/chat/completions`` (their responses:
``openai_objects``; what every API's bodies share, errors and messages: ``protocol``).

Requests take the extras clients send by default (``user``, ``store: false``) but reject every field whose
meaning we would silently ignore (``suffix``, ``logit_bias``, the legacy ``functions``, ``reasoning_effort``,
unknown names; see ``request_fields``): a client that asks for a feature must hear that it is missing rather
than get a plausible wrong answer. Structured outputs come as ``response_format``, ``structured_outputs`` or
``guided_*``.
Sampling values are range-checked by ``SamplingParams``, whose messages name the field; pydantic here
only checks types, so every range rule lives in one place. Those types are strict where the OpenAI API says
integer, number or boolean: pydantic's lax mode would read ``true`` as 1, ``"5"`` as 5 and ``1`` as true,
so a client's mistake would run as some other request instead of being refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from pagedkv.entrypoints.server.protocol import APIError, ChatMessage, prompt_shape, sampling_params, spec_message
from pagedkv.entrypoints.server.request_fields import refuse_unhonoured
from pagedkv.sampling_params import SamplingParams
from pagedkv.structured import StructuredOutputsParams

SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "prompt_logprobs",
)
# The fields that ask for structured outputs: OpenAI's, vLLM's, and vLLM's older guided_* names.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
GRAMMAR_FIELDS = ("response_format", "structured_outputs", *GUIDED)
READ_EXTRAS = frozenset(GRAMMAR_FIELDS)  # the fields read from a body's extras; other extras: request_fields


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # vLLM's continuous_usage_stats, say, is not honoured: a 400

    include_usage: StrictBool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: StrictInt = 1
    temperature: StrictFloat | None = None  # StrictFloat takes an integer too, as JSON's number does
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's extra field: the prompt tokens' logprobs and top-k
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None

    def check_supported(self) -> None:
        refuse_unhonoured(self.model_extra or {}, READ_EXTRAS)

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams arguments the client set; unset ones keep SamplingParams' defaults."""
        kwargs = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        structured = self.structured_outputs()
        if structured is not None:
            kwargs["structured_outputs"] = structured
        return kwargs

    def _grammar_fields(self) -> dict[str, Any]:
        """The structured-output fields this request set, in ``GRAMMAR_FIELDS`` order; ``response_format``
        ``{"type": "text"}`` (OpenAI's default) asks for no grammar."""
        extra = self.model_extra or {}
        given = {name: extra[name] for name in GRAMMAR_FIELDS if extra.get(name) is not None}
        if given.get("response_format") == {"type": "text"}:
            del given["response_format"]
        return given

    def grammar_renames(self) -> dict[str, str]:
        """The engine reports grammar errors as ``structured_outputs``: name the field this request used."""
        return {"structured_outputs": next(iter(self._grammar_fields()), "structured_outputs")}

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar asked for by ``response_format`` (OpenAI), ``structured_outputs`` (vLLM) or a
        ``guided_*`` field (vLLM's older names); at most one of them. A 400 names what is wrong."""
        given = self._grammar_fields()
        if len(given) > 1:
            raise APIError(400, f"ask for one structured output, got {', '.join(given)}", param=next(iter(given)))
        if not given:
            return None
        name, value = next(iter(given.items()))
        try:
            if name == "response_format":
                return _response_format(value)
            if name in GUIDED:
                return StructuredOutputsParams.from_dict({GUIDED[name]: value}, name)
            return StructuredOutputsParams.from_dict(value, name)
        except ValueError as exc:
            raise APIError(400, spec_message(name, str(exc)), param=name) from exc

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        """One error for a bad list, not one per item and per union member (validation must not amplify)."""
        if isinstance(value, list) and not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        return value


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False  # the prompt comes back before the completion (with logprobs: scored, first token None)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return prompt_shape(value, "prompt")

    def to_sampling_params(self) -> SamplingParams:
        """``echo`` with ``logprobs: k`` scores the prompt too: that is the evaluation harnesses' call
        (with ``max_tokens: 0``), so the engine computes prompt logprobs with the larger of the two k's."""
        extra = {"max_tokens": self.max_tokens, "logprobs": self.logprobs}
        k = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # out-of-range values go on to SamplingParams' checks
            extra["prompt_logprobs"] = (
                self.logprobs if k is None or min(k, self.logprobs) < 0 else max(k, self.logprobs)
            )
        return sampling_params(self.sampling_kwargs() | extra)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    # Checked by tool_calls.plan_tools, which names the field at fault.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    chat_template_kwargs: Any = None  # checked by chat_templates.check_template_kwargs, which names the key

    def param_renames(self) -> dict[str, str]:
        """This request's names of the sampling parameters whose errors name them: the chat API's logprobs
        count is ``top_logprobs``, and ``max_completion_tokens`` is ``max_tokens`` when it is given."""
        renames = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return renames

    def to_sampling_params(self, tool_grammar: StructuredOutputsParams | None = None) -> SamplingParams:
        """``tool_grammar``: the answer format that tool calling asks for (no other grammar may be given)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        renames = self.param_renames()
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        if max_tokens == 0:
            raise APIError(
                400,
                f"{renames.get('max_tokens', 'max_tokens')} must be >= 1 for a chat completion (to score a prompt "
                "without generating, use /v1/completions with max_tokens 0 and echo or prompt_logprobs)",
                param=renames.get("max_tokens", "max_tokens"),
            )
        extra = {"max_tokens": max_tokens, "logprobs": logprobs}
        if tool_grammar is not None:
            if self.structured_outputs() is not None:
                raise APIError(400, "tools and a structured output cannot be combined: drop one", param="tools")
            extra["structured_outputs"] = tool_grammar
        return sampling_params(self.sampling_kwargs() | extra, renames)


def _response_format(value: Any) -> StructuredOutputsParams:
    """OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ...}}``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")
