"""What ``POST /v1/responses`` answers: the ``response`` object, its output items, usage and stream events.

Field names and nesting follow OpenAI's Responses API exactly (the ``openai`` package's
``types/responses``), since clients parse these with typed models. The tests validate every body and event
against those models.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedkv.engine.request_stream import RequestStream
from pagedkv.kv import cache_report


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The assistant's text answer; ``status`` is ``incomplete`` when max_output_tokens cut it."""

    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A call the model made; the client answers it with a ``function_call_output`` item of this call_id."""

    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A thinking model's thinking, split from its answer by the server's ``--reasoning-parser``."""

    id: str = Field(default_factory=lambda: new_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # read from the prefix cache
    cache_write_tokens: int = 0  # the prompt's full blocks computed now and kept for later hits


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    cache_miss_reason: str | None = None  # pagedkv's extension, as on the chat route (pagedkv.kv.cache_report)


def response_usage(stream: RequestStream, block_size: int, prefix_caching: bool) -> ResponseUsage:
    """Token counts of the one prompt. The cache keeps only full blocks of a prompt, so the tokens written
    are those of its full blocks that were not read from it (none when prefix caching is off)."""
    cached = sum(stream.cached_tokens.values())
    full_blocks = stream.prompt_tokens // block_size * block_size
    written = max(0, full_blocks - cached) if prefix_caching else 0
    return ResponseUsage(
        input_tokens=stream.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached, cache_write_tokens=written),
        output_tokens=stream.completion_tokens,
        total_tokens=stream.prompt_tokens + stream.completion_tokens,
        cache_miss_reason=cache_report.aggregate(list(stream.cache_miss_reasons.values())),
    )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The ``response`` object: the request's settings echoed, the output, its status and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[Any] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None

    @property
    def output_text(self) -> str:
        """All the answer's text (what the ``openai`` client's ``output_text`` property gives)."""
        return "".join(p.text for item in self.output if isinstance(item, OutputMessage) for p in item.content)


class EventCounter:
    """Numbers a stream's events: every event carries ``sequence_number``, counting from 0."""

    def __init__(self) -> None:
        self.next = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.next, **fields}
        self.next += 1
        return event
