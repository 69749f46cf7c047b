"""JSON given as text inside a request (a JSON schema as a string), parsed with a bound on its nesting.

``json.loads`` recurses once per level: text nested ~1,000 levels deep raised ``RecursionError``, which no
caller expects (it is no ValueError), so a request carrying it failed with a 500 instead of a 400. The depth
is counted first, in one pass over the text with its strings blanked out, and the parse happens only when
it is within the bound.
"""

from __future__ import annotations

import json
import re
from typing import Any

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a JSON string, escapes included
_BRACKET = re.compile(r"[\[\]{}]")


def nesting_depth(text: str, stop_past: int | None = None) -> int:
    """How deep the arrays and objects of ``text`` nest (brackets inside strings do not count); stops
    counting as soon as the depth passes ``stop_past``. Malformed text may be over-counted, never under."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_past is not None and deepest > stop_past:
                    break
        else:
            depth -= 1
    return deepest


def loads_bounded(text: str, max_depth: int) -> Any:
    """``json.loads(text)``, or ValueError if it nests deeper than ``max_depth`` levels (or is no JSON)."""
    if nesting_depth(text, stop_past=max_depth) > max_depth:
        raise ValueError(f"it nests deeper than {max_depth} levels")
    return json.loads(text)
