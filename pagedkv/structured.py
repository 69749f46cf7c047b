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
Every grammar is also probed when it is compiled (``grammar_probe``): one that matches nothing or breaks the
library's limits at its first steps is refused here, as an InvalidParameter naming the field, and that
refusal is cached too. The server compiles on a pool of its own (``pagedkv.engine.grammar_pool``), never on
the thread that delivers streams, and hands the compiled grammar to the request's builder (``holding``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from pagedkv.errors import InvalidParameter
from pagedkv.grammar_probe import probe
from pagedkv.json_text import loads_bounded
from pagedkv.lark_base_case import never_ending_rules
from pagedkv.reasoning_grammar import REASONING_PARSERS, after_thinking

KINDS = ("json", "regex", "choice", "grammar", "json_object")
CACHE_SIZE = 256  # compiled grammars (and refusals) kept, least recently used dropped
# Bounds on compiling and on each step's mask, so a pathological grammar fails its request with a 400 (at
# compile time) or an error (later), instead of stalling the engine: llguidance's own defaults, made explicit.
# Errors are short (not the parser's whole state): they become the 400's message.
LIMITS = {
    "max_grammar_size": 500_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "verbose_errors": False,
}
# A choice is one alternative per string, and llguidance's parser holds at most 2,000 items in a step
# (``max_items_in_row``): 2,000 strings already failed at the first token. Past this, give a regex or grammar.
MAX_CHOICES = 1000
# A JSON schema given as text is parsed only if it nests at most this deep (json.loads recurses: ~1,000
# levels raised RecursionError); llguidance itself refuses schemas past 128 levels.
MAX_SPEC_DEPTH = 64
# JSON may be pretty-printed, but a run of whitespace is bounded: small models can otherwise fall into writing
# newlines forever, and every such answer would end at max_tokens as invalid JSON.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,32}"}


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema as a dict or JSON text), ``regex``, ``choice`` (a list of
    strings), ``grammar`` (Lark syntax, or GBNF with ``::=``), ``json_object=True`` (any JSON object).

    ``reasoning``: a reasoning parser's name (``reasoning_grammar.REASONING_PARSERS``); the grammar then holds
    for the answer after the model's ``<think>...</think>``, not for the thinking."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            message = f"structured_outputs.reasoning must be one of {REASONING_PARSERS}, got {self.reasoning!r}"
            raise InvalidParameter("structured_outputs", message)
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
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
        if kind == "choice" and len(value) > MAX_CHOICES:
            message = (
                f"structured_outputs.choice has {len(value)} strings, at most {MAX_CHOICES}: "
                "give a regex or a grammar for more"
            )
            raise InvalidParameter("structured_outputs", message)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def to_grammar(self) -> str:
        """The grammar in llguidance's format; InvalidParameter if it cannot be written down at all."""
        grammar = self._answer_grammar()
        return grammar if self.reasoning is None else after_thinking(grammar, self.reasoning)

    def _answer_grammar(self) -> str:
        kind = self.kind
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = loads_bounded(schema, MAX_SPEC_DEPTH)
                except ValueError as exc:
                    raise InvalidParameter("structured_outputs", f"structured_outputs.json is not JSON: {exc}") from exc
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (TypeError, ValueError, RecursionError) as exc:
                message = f"structured_outputs.json is not a valid JSON schema: {exc}"
                raise InvalidParameter("structured_outputs", message) from exc
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        grammar = self.grammar
        if "::=" in grammar:  # GBNF (llama.cpp's and xgrammar's EBNF dialect)
            try:
                grammar = gbnf_to_lark(grammar)  # the function: llguidance.gbnf_to_lark is its module
            except (TypeError, ValueError) as exc:
                message = f"structured_outputs.grammar is not valid GBNF: {exc}"
                raise InvalidParameter("structured_outputs", message) from exc
        never_ending = never_ending_rules(grammar)
        if never_ending:  # compiles, and its first masks are fine, but no text ever completes it
            names = ", ".join(never_ending[:5]) + (", ..." if len(never_ending) > 5 else "")
            message = (
                f"structured_outputs.grammar matches no text: the rules {names} can never end (each of their "
                "alternatives needs one of them again): give each recursive rule a base case"
            )
            raise InvalidParameter("structured_outputs", message)
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
    """Compiles grammars into probed matchers for one tokenizer and vocabulary; thread-safe.

    The lock guards only the cache: compiles run outside it (llguidance drops the GIL while it builds a
    grammar), so a thread looking up a cached grammar never waits behind another's compile.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = CACHE_SIZE
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.3 s)
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()  # a template, or why not
        self._held: dict[int, tuple[StructuredOutputsParams, llguidance.LLMatcher, int]] = {}
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled and probed template for ``params`` (do not step it: copy it); InvalidParameter naming
        the problem if it does not compile or fails its probe. Cached by content, refusals included."""
        grammar = params.to_grammar()
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
        if cached is None:
            cached = self._compile(grammar)
            with self._lock:
                self._cache[grammar] = cached
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise InvalidParameter("structured_outputs", f"structured_outputs.{params.kind} {cached}")
        return cached

    def _compile(self, grammar: str) -> llguidance.LLMatcher | str:
        template = llguidance.LLMatcher(self._tokenizer(), grammar, limits=llguidance.LLParserLimits(**LIMITS))
        if template.is_error():
            return f"does not compile: {template.get_error().strip()[:500]}"
        reason = probe(template, self.vocab_size, self._eos)
        return template if reason is None else f"cannot be used: {reason}"

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for ``params``: a copy of the template ``holding`` gave for this very object, or
        of the compiled one (compiled here, on the caller's thread, if it is not cached)."""
        held = self._held.get(id(params))
        if held is not None and held[0] is params:
            return held[1].deep_copy()
        return self.compile(params).deep_copy()

    @contextmanager
    def holding(self, params: StructuredOutputsParams | None, template: llguidance.LLMatcher | None) -> Iterator[None]:
        """While the block runs, ``matcher(params)`` copies ``template`` (compiled elsewhere, e.g. on the
        grammar pool) without looking at the cache or compiling: the cache may have dropped it meanwhile,
        and the thread building requests must never compile."""
        if params is None or template is None:
            yield
            return
        key = id(params)
        with self._lock:
            _, _, count = self._held.get(key, (params, template, 0))
            self._held[key] = (params, template, count + 1)
        try:
            yield
        finally:
            with self._lock:
                _, _, count = self._held[key]
                if count > 1:
                    self._held[key] = (params, template, count - 1)
                else:
                    del self._held[key]


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
