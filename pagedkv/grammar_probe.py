"""Probing a compiled grammar before its request is admitted, so the engine never fails a request for its spec.

llguidance compiles lazily: a grammar that matches nothing (a regex such as ``[^\\s\\S]``, a ``$ref`` cycle, a
Lark rule with no base case), one whose first lexer is too big (``a{1000000}``) or one too wide for a parser
step (a ``choice`` of 2,000 strings, an object with 600 optional properties: over ``max_items_in_row``)
compiles without an error and fails only when its first masks are computed -- which used to happen inside an
engine step, where the request then died with a 500 and the reason went only to the log.

So each compiled grammar is walked for a few tokens here, on a copy, exactly as the engine would: compute
the mask (the same call the engine makes), refuse it if the matcher is in error or allows nothing, then
consume one allowed token (the lowest id that is not end-of-sequence: the shortest pieces walk the most
grammar states) and go on, until the grammar accepts with only end-of-sequence left, or ``PROBE_STEPS``
masks passed. This proves the start of the language is not empty and the first steps fit the library's
limits; a grammar that fails only after many tokens still can (the engine then stops that request alone).
"""

from __future__ import annotations

from collections.abc import Collection

import llguidance
import torch

PROBE_STEPS = 8
_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(matcher: llguidance.LLMatcher, vocab_size: int) -> list[int]:
    """The ids the matcher allows next, from the same bitmask the engine computes each step."""
    words = (vocab_size + 31) // 32
    mask = torch.zeros(words, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * mask.element_size())  # GIL released
    bits = ((mask.unsqueeze(-1) >> _BITS) & 1).view(-1)[:vocab_size]
    return bits.nonzero().flatten().tolist()


def probe(template: llguidance.LLMatcher, vocab_size: int, eos_token_ids: Collection[int]) -> str | None:
    """None if the grammar's first steps work; else why not, in words a client can act on."""
    matcher = template.deep_copy()
    eos = set(eos_token_ids)
    for _ in range(PROBE_STEPS):
        allowed = allowed_tokens(matcher, vocab_size)
        if matcher.is_error():
            return _reason(matcher.get_error())
        text_tokens = [t for t in allowed if t not in eos]
        if not text_tokens:
            if allowed and matcher.is_accepting():
                return None  # a whole string is matched: the language is not empty
            return "it matches no text at all (a regex that matches nothing, a $ref cycle, a rule with no base case?)"
        if not matcher.consume_token(text_tokens[0]):
            return _reason(matcher.get_error())
    return None


def _reason(error: str) -> str:
    """llguidance's error, first line only (the rest is the parser's state), with what to change."""
    line = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if len(line) > 300:
        line = line[:300] + "..."
    if "NoExtensionBias" in line:
        return "it matches no text at all (a regex that matches nothing, a $ref cycle, a rule with no base case?)"
    if "max is" in line and "items" in line:  # "Current row has 2407 items; max is 2000; ..."
        return (
            f"it offers too many alternatives at one point for the grammar engine ({line}): use fewer choices "
            "or optional properties, or split the structure"
        )
    if "Too many items" in line:
        return (
            f"it is too ambiguous, repetitive or recursive for the grammar engine ({line}): use smaller "
            "repetition counts, and give each recursive rule a base case"
        )
    if "lexer" in line or "too many expressions" in line or "fuel" in line:
        return f"its tokens are too complex for the grammar engine ({line}): use smaller repetition counts"
    return line
