"""Which rules of a Lark grammar can never end: each alternative needs a rule that never ends (no base case).

``start: "y" a`` with ``a: "x" a | "z" a`` matches no text at all, yet llguidance compiles it and its first
masks are fine, so the probe (``grammar_probe``) lets it through and the model writes ``yxzxz...`` until
``max_tokens``. This is the classic productive-symbols fixpoint, run on the grammar's text: a rule is
productive if one of its alternatives holds only productive items (a literal, a regex, an optional or
repeated-zero-times item, a productive rule), and ``start`` must be productive.

It is deliberately conservative, since a false refusal would break a valid grammar: anything it does not
parse (llguidance's dialect has more than Lark's) makes it answer "unknown", a name it does not see defined
(an ``%import``) counts as productive, and so does every ``%json``/``%regex``/``%lark`` block and special
token.
"""

from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(
    r"""
    (?P<comment>//[^\n]*)
  | (?P<newline>\n)
  | (?P<space>[ \t\r]+)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:\[(?:[^\]\\\n]|\\.)*\]|[^/\\\n\[]|\\.)+/[imslux]*)
  | (?P<special><\|[^|\n]*\|>|<\[[^\]\n]*\]>)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<name>@?[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>\d+)
  | (?P<punct>\.\.|->|[:|()\[\]?*+~.,{}=!&])
    """,
    re.VERBOSE,
)


MAX_WORK = 500_000  # items looked at in all (~0.2 s); each rule is looked at about once per rule it names


class Unknown(Exception):
    """The text holds something this reader does not understand: no verdict."""


def never_ending_rules(text: str) -> list[str] | None:
    """The rules reachable from ``start`` that cannot end, if ``start`` is one of them; [] if it can end;
    None if the text could not be read with certainty."""
    try:
        return _never_ending(_rules(_tokens(text)))
    except (Unknown, RecursionError):  # RecursionError: parentheses nested too deep to read here
        return None


def _never_ending(rules: dict[str, Any]) -> list[str] | None:
    if "start" not in rules:
        return None
    users: dict[str, set[str]] = {name: set() for name in rules}  # the rules whose bodies name each rule
    for name, body in rules.items():
        for ref in _refs(body):
            if ref in users:
                users[ref].add(name)
    sizes = {name: _size(body) for name, body in rules.items()}
    productive: set[str] = set()
    pending, budget = list(rules), MAX_WORK  # a worklist: a rule is looked at again only when a
    while pending:  # rule it names has just become productive
        name = pending.pop()
        if name in productive:
            continue
        budget -= sizes[name]
        if budget < 0:
            return None  # no verdict rather than quadratic time on a hostile grammar
        if _ends(rules[name], rules, productive):
            productive.add(name)
            pending.extend(users[name] - productive)
    if "start" in productive:
        return []
    reachable, stack = set(), ["start"]
    while stack:
        name = stack.pop()
        if name in reachable or name not in rules:
            continue
        reachable.add(name)
        stack.extend(_refs(rules[name]))
    return sorted(reachable - productive)


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise Unknown(text[position : position + 20])
        kind = match.lastgroup
        if kind == "directive" and match.group() in ("%json", "%regex", "%lark", "%llguidance"):
            position = _skip_block(text, match.end())  # an opaque block: a productive atom
            tokens.append(("block", match.group()))
            continue
        if kind not in ("comment", "space"):
            tokens.append((kind, match.group()))
        position = match.end()
    return tokens


def _skip_block(text: str, position: int) -> int:
    """Past the ``{...}`` that follows a directive (strings inside may hold braces)."""
    while position < len(text) and text[position] in " \t":
        position += 1
    if position >= len(text) or text[position] != "{":
        raise Unknown("a directive without its block")
    depth, in_string, escaped = 0, False, False
    for index in range(position, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index + 1
    raise Unknown("an unclosed block")


def _rules(tokens: list[tuple[str, str]]) -> dict[str, Any]:
    """Each rule's (or terminal's) body as a tree of ("any" | "all", children), ("ref", name) and True."""
    statements: list[list[tuple[str, str]]] = [[]]
    for token in tokens:  # a line that starts with "|" continues the rule above it
        if token[0] == "newline":
            statements.append([])
        else:
            statements[-1].append(token)
    merged: list[list[tuple[str, str]]] = []
    for statement in statements:
        if statement and statement[0] == ("punct", "|") and merged:
            merged[-1].extend(statement)
        elif statement:
            merged.append(statement)
    rules: dict[str, Any] = {}
    for statement in merged:
        if statement[0][0] in ("directive", "block"):  # %import, %ignore, %llguidance {...}: no rule
            continue
        name, body = _definition(statement)
        if name in rules:
            raise Unknown(f"{name} defined twice")
        parser = _Body(body)
        rules[name] = parser.alternatives()
        if parser.position != len(body):
            raise Unknown(f"the rest of {name}")
    return rules


def _definition(statement: list[tuple[str, str]]) -> tuple[str, list[tuple[str, str]]]:
    """``?name[attributes].priority: body`` -> (name, body)."""
    index = 1 if statement[0] in (("punct", "?"), ("punct", "!")) else 0
    if index >= len(statement) or statement[index][0] != "name":
        raise Unknown("a statement that is no rule")
    name = statement[index][1]
    index += 1
    if index < len(statement) and statement[index] == ("punct", "["):  # attributes, e.g. [stop="..."]
        while index < len(statement) and statement[index] != ("punct", "]"):
            index += 1
        index += 1
    if index + 1 < len(statement) and statement[index] == ("punct", ".") and statement[index + 1][0] == "number":
        index += 2
    if index >= len(statement) or statement[index] != ("punct", ":"):
        raise Unknown(f"no ':' after {name}")
    return name, statement[index + 1 :]


class _Body:
    """Recursive descent over one rule's body: alternatives of sequences of items with postfix operators."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.position = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise Unknown("the body ended early")
        self.position += 1
        return token

    def alternatives(self) -> Any:
        options = [self.sequence()]
        while self.peek() == ("punct", "|"):
            self.take()
            options.append(self.sequence())
        return ("any", options)

    def sequence(self) -> Any:
        items = []
        while self.peek() is not None and self.peek() not in (("punct", "|"), ("punct", ")"), ("punct", "]")):
            items.append(self.item())
        return ("all", items)

    def item(self) -> Any:
        atom = self.atom()
        while True:
            token = self.peek()
            if token in (("punct", "?"), ("punct", "*")):
                self.take()
                atom = True
            elif token == ("punct", "+"):
                self.take()
            elif token == ("punct", "~"):  # item ~ n, or item ~ n..m
                self.take()
                low = self.take()
                if low[0] != "number":
                    raise Unknown("~ without a count")
                if self.peek() == ("punct", ".."):
                    self.take()
                    if self.take()[0] != "number":
                        raise Unknown("~ n.. without an end")
                if int(low[1]) == 0:
                    atom = True
            elif token == ("punct", "->"):  # an alias names the alternative: no change to what it matches
                self.take()
                self.take()
            else:
                return atom

    def atom(self) -> Any:
        kind, value = self.take()
        if kind == "string":
            if self.peek() == ("punct", ".."):  # "a".."z"
                self.take()
                if self.take()[0] != "string":
                    raise Unknown("a range without its end")
            return True
        if kind in ("regex", "special", "block"):
            return True
        if kind == "name":
            return True if value.startswith("@") else ("ref", value)
        if (kind, value) == ("punct", "("):
            inner = self.alternatives()
            if self.take() != ("punct", ")"):
                raise Unknown("an unclosed (")
            return inner
        if (kind, value) == ("punct", "["):
            self.alternatives()
            if self.take() != ("punct", "]"):
                raise Unknown("an unclosed [")
            return True
        raise Unknown(f"{value!r} where an item was expected")


def _ends(body: Any, rules: dict[str, Any], productive: set[str]) -> bool:
    if body is True:
        return True
    kind, children = body
    if kind == "ref":
        return children not in rules or children in productive
    if kind == "any":
        return any(_ends(child, rules, productive) for child in children)
    return all(_ends(child, rules, productive) for child in children)


def _size(body: Any) -> int:
    return 1 if body is True or body[0] == "ref" else 1 + sum(_size(child) for child in body[1])


def _refs(body: Any) -> list[str]:
    if body is True:
        return []
    kind, children = body
    if kind == "ref":
        return [children]
    return [name for child in children for name in _refs(child)]
