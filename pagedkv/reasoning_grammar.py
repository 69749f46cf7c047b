"""A structured output for a thinking model: free thinking up to ``</think>``, then the grammar, for the
answer part only.

With ``--reasoning-parser``, the client's grammar (a JSON schema, regex, choice, Lark grammar, or the format
of forced tool calls) describes the answer, which comes after the thinking. Applied from the first token,
it would forbid the thinking itself. So the grammar is wrapped in one that first lets any text through, up
to and including the first ``</think>`` (a lazy lexeme: it ends at the first match), and only then asks
for the client's grammar; end-of-sequence is allowed only once that is complete. The thinking follows the
parser's own rule (``entrypoints.reasoning``): ``deepseek_r1`` always thinks first (the template opened the
thinking), ``qwen3`` either opens with ``<think>`` or answers at once.

The client's grammar is a separate grammar of the same llguidance grammar set, referenced as ``@answer``,
so any kind works unchanged and none of its rule names can collide with the wrapper's.
"""

from __future__ import annotations

import json

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")

_THINKING = {
    "deepseek_r1": "start: thinking @answer",
    "qwen3": f"start: ({json.dumps(THINK_START)} thinking)? @answer",
}


def after_thinking(grammar: str, parser: str) -> str:
    """``grammar`` (llguidance's format: a grammar set as JSON, or Lark text) as the answer after the thinking
    that ``parser`` expects."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
    grammar_set = grammar.lstrip().startswith("{")  # Lark text never starts with a brace
    answer = json.loads(grammar)["grammars"] if grammar_set else [{"lark_grammar": grammar}]
    answer = [dict(answer[0], name="answer"), *answer[1:]]
    wrapper = "\n".join(
        [
            "%llguidance {}",
            _THINKING[parser],
            f"thinking[lazy]: THINKING_TEXT {json.dumps(THINK_END)}",
            r"THINKING_TEXT: /(.|\n)*/",
        ]
    )
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": wrapper}, *answer]})
