"""Structured outputs: a grammar per request -- a JSON schema, any JSON object, a regex, a choice of strings or
a Lark grammar -- that every sampled token must follow (vLLM's ``StructuredOutputsParams``).

The grammar engine is llguidance (the library behind vLLM's ``guidance`` backend): a Rust Earley parser with a
lazy lexer that computes, for the current state, the bitmask of allowed tokens over the whole vocabulary in
tens of microseconds, and needs neither torch nor a GPU toolchain (xgrammar, the other choice, requires an
unpinned torch and triton; measured side by side in the issue note). Each request owns one matcher: the mask
of its next token is applied to its logits row before sampling, and every accepted token advances it
(:class:`pagedkv.engine.request.Request` does both, the engine core computes the masks).

Compiling is bounded (``LLParserLimits``) and cached by content: a request copies a compiled matcher
(``deep_copy``) instead of compiling the same schema again, so a burst of requests with one schema pays once.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import llguidance
import llguidance.hf
import torch

from pagedkv.errors import InvalidParameter

KINDS = ("json", "regex", "choice", "grammar", "json_object")
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped
# Bounds on compiling and on each step's mask, so a pathological grammar fails its request with a 400 (at
# compile time) or an error (later), instead of stalling the engine: llguidance's own defaults, made explicit.
LIMITS = {"max_grammar_size": 500_000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000}
# JSON may be pretty-printed, but a run of whitespace is bounded: small models can otherwise fall into writing
# newlines forever, and every such answer would end at max_tokens as invalid JSON.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,32}"}


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema as a dict or JSON text), ``regex``, ``choice`` (a list of
    strings), ``grammar`` (Lark syntax, or GBNF with ``::=``), ``json_object=True`` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) or "none"
            raise InvalidParameter("structured_outputs", f"give exactly one of {', '.join(KINDS)}, got {what}")
        kind = given[0]
        value = getattr(self, kind)
        expected = {"json": (dict, str), "regex": str, "choice": list, "grammar": str, "json_object": bool}[kind]
        if not isinstance(value, expected):
            raise InvalidParameter("structured_outputs", f"structured_outputs.{kind} has the wrong type")
        if kind == "choice" and (not value or not all(isinstance(c, str) and c for c in value)):
            raise InvalidParameter("structured_outputs", "structured_outputs.choice must be non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def to_grammar(self) -> str:
        """The grammar in llguidance's format; InvalidParameter if it cannot be written down at all."""
        kind = self.kind
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise InvalidParameter("structured_outputs", f"structured_outputs.json is not JSON: {exc}") from exc
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (TypeError, ValueError) as exc:
                message = f"structured_outputs.json is not a valid JSON schema: {exc}"
                raise InvalidParameter("structured_outputs", message) from exc
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        grammar = self.grammar
        if "::=" in grammar:  # GBNF (llama.cpp's and xgrammar's EBNF dialect)
            try:
                grammar = llguidance.gbnf_to_lark(grammar)
            except (TypeError, ValueError) as exc:
                message = f"structured_outputs.grammar is not valid GBNF: {exc}"
                raise InvalidParameter("structured_outputs", message) from exc
        return llguidance.LLMatcher.grammar_from_lark(grammar)

    @classmethod
    def from_dict(cls, value: Any, param: str = "structured_outputs") -> StructuredOutputsParams:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict) or not set(value) <= set(KINDS):
            raise InvalidParameter(param, f"{param} must be an object with one of the keys {', '.join(KINDS)}")
        try:
            return cls(**value)
        except InvalidParameter as exc:
            raise InvalidParameter(param, str(exc)) from exc


def lark_json(schema: dict) -> str:
    """A JSON schema to embed in a Lark grammar (``rule: %json {...}``), with the same options as ``json``."""
    options = JSON_OPTIONS | schema.get("x-guidance", {})
    return json.dumps(schema | {"x-guidance": options})


class GrammarCompiler:
    """Compiles grammars into matchers for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.3 s)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for ``params``; InvalidParameter naming the problem if it does not compile."""
        grammar = params.to_grammar()
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                return template.deep_copy()
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            template = llguidance.LLMatcher(self._ll_tokenizer, grammar, limits=llguidance.LLParserLimits(**LIMITS))
            if template.is_error():
                error = template.get_error()
                message = f"structured_outputs.{params.kind} does not compile: {error}"
                raise InvalidParameter("structured_outputs", message)
            self._cache[grammar] = template
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return template.deep_copy()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_masks(matcher: llguidance.LLMatcher, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The allowed-token bitmasks ``[1 + len(drafts), words]`` for a request's rows this step: its next token,
    then the token after each draft (the matcher steps through the drafts and back)."""
    masks = torch.full((1 + len(drafts), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    row_bytes = masks.shape[1] * masks.element_size()
    matcher.unsafe_compute_mask_ptr(masks[0].data_ptr(), row_bytes)  # writes the row in place, GIL released
    for i, token in enumerate(drafts, start=1):
        if not matcher.consume_token(token):
            raise RuntimeError("a draft the grammar had accepted was refused")
        matcher.unsafe_compute_mask_ptr(masks[i].data_ptr(), row_bytes)
    if drafts:
        matcher.rollback(len(drafts))
    return masks


_BITS = torch.arange(32, dtype=torch.int32)


@torch.inference_mode()  # the logits come out of the model's inference mode
def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place (rows of unconstrained requests: all bits set).

    Bit ``t % 32`` of word ``t // 32`` allows token t. Unpacked with three tensor ops rather than llguidance's
    helper, which is ``torch.compile``d: its first call compiled for seconds, inside the first step.
    """
    allowed = ((masks.unsqueeze(-1) >> _BITS) & 1).view(masks.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))
