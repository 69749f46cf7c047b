"""Reasoning parsers (``pagedkv serve --reasoning-parser``): a thinking model's ``<think>...</think>`` apart
from its answer, as ``reasoning_content`` and ``content`` (vLLM's names and parsers).

* ``deepseek_r1`` -- the template opens the thinking in the prompt (DeepSeek-R1 distills), so the output is
  reasoning from its first character up to ``</think>`` (a leading ``<think>`` the model writes anyway is
  dropped); an output that never closes it is all reasoning.
* ``qwen3`` -- the model opens the thinking itself, or not at all (Qwen3 with ``enable_thinking`` false):
  only an output that starts with ``<think>`` has reasoning, up to ``</think>``; any other is all content.

The split works on text, so a tag is found however the tokenizer cuts it (one added token, or ``<``,
``think``, ``>``) and wherever stream deltas cut it: text that may be the start of a tag is held back until
the next delta decides. A whole answer goes through the same splitter in one piece, so a streamed answer's
deltas always join to the whole answer's parts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedkv.reasoning_grammar import REASONING_PARSERS, THINK_END, THINK_START
from pagedkv.sampling_params import SamplingParams


@dataclass(slots=True)
class Split:
    """One piece of output, divided: the reasoning part and the answer part (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """The split of one sample's text, fed delta by delta. States: ``start`` (deciding whether the output
    opens with ``<think>``), ``reasoning`` (until ``</think>``), ``content`` (the rest, passed through)."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
        self.parser = parser
        self.state = "start"
        self.held = ""  # text that may be the beginning of the tag this state looks for

    def feed(self, text: str) -> Split:
        """The parts of ``text`` (with what was held back before) that are decided now."""
        split = Split()
        text = self.held + text
        self.held = ""
        if self.state == "start":
            if len(text) < len(THINK_START) and THINK_START.startswith(text):  # too short to tell
                self.held = text
                return split
            opened = text.startswith(THINK_START)
            if opened:
                text = text[len(THINK_START) :]
            self.state = "reasoning" if opened or self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                keep = _tag_prefix_length(text, THINK_END)
                split.reasoning, self.held = text[: len(text) - keep], text[len(text) - keep :]
                return split
            split.reasoning, text = text[:end], text[end + len(THINK_END) :]
            self.state = "content"
        split.content = text
        return split

    def finish(self) -> Split:
        """What was held back when the output ends: the part it would have continued."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.parser == "deepseek_r1"):
            return Split(reasoning=held)
        return Split(content=held)


def split_reasoning(parser: str, text: str) -> Split:
    """A whole answer's reasoning and content."""
    splitter = ReasoningSplitter(parser)
    split, rest = splitter.feed(text), splitter.finish()
    return Split(split.reasoning + rest.reasoning, split.content + rest.content)


def _tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag`` (0 if none)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def for_the_answer(parser: str | None, params: SamplingParams) -> SamplingParams:
    """``params`` whose structured output (a client's, or forced tool calls') holds for the answer after the
    thinking only (see ``reasoning_grammar``), when a reasoning parser splits the output."""
    if parser is None or params.structured_outputs is None:
        return params
    return replace(params, structured_outputs=replace(params.structured_outputs, reasoning=parser))
