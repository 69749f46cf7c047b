"""The door checks of structured outputs that need no model (issue 25 row 4): JSON text read with a depth
bound, and Lark grammars whose start can never end -- found without refusing any grammar that can."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark

from pagedkv import lark_base_case
from pagedkv.errors import InvalidParameter
from pagedkv.json_text import loads_bounded, nesting_depth
from pagedkv.lark_base_case import never_ending_rules
from pagedkv.structured import MAX_CHOICES, StructuredOutputsParams


def test_json_text_is_parsed_only_within_the_depth_bound():
    assert loads_bounded('{"a": [1, {"b": "[[[["}]}', 3) == {"a": [1, {"b": "[[[["}]}  # brackets in strings
    assert nesting_depth('["\\"[[", [[]]]') == 3
    for deep in ("[" * 5000 + "]" * 5000, '{"a": ' * 5000 + "1" + "}" * 5000, "[" * 100_000):
        with pytest.raises(ValueError, match="deeper than 64"):
            loads_bounded(deep, 64)
    with pytest.raises(ValueError):
        loads_bounded("{not json", 64)
    # Linear in the text: 4x the strings take ~4x as long (16x if each string rescanned what came before).
    # Both texts are past 256 KB, where the copies cost alike per byte (from 100 to 200 KB the time per byte
    # doubles here, whatever the algorithm)
    ratio = scaling_ratio(nesting_depth, *(json.dumps({"k": ["x" * 50] * n}) for n in (8000, 32000)))
    assert ratio < 8, f"4x the text took {ratio:.1f}x as long: not linear (limit: between 4x and 16x)"


def test_a_schema_given_as_deep_text_is_a_parameter_error_not_a_recursion_error():
    with pytest.raises(InvalidParameter, match="nests deeper than 64 levels") as caught:
        StructuredOutputsParams(json="[" * 1000 + "]" * 1000).to_grammar()
    assert caught.value.param == "structured_outputs"


def test_choices_are_capped():
    StructuredOutputsParams(choice=["x"] * MAX_CHOICES)
    with pytest.raises(InvalidParameter, match=f"at most {MAX_CHOICES}"):
        StructuredOutputsParams(choice=["x"] * (MAX_CHOICES + 1))


NEVER_ENDING = [
    ('start: a\na: "x" a', ["a", "start"]),
    ('start: "y" a\na: "x" a | "z" a', ["a", "start"]),
    ('start: start "x"', ["start"]),
    ("start: a\na: b\nb: a", ["a", "b", "start"]),
    ('start: a ~ 2\na: "x" a', ["a", "start"]),
    ('start: (a "q")+\na: "x" a', ["a", "start"]),
    ('start: expr\nexpr: expr "+" term\n    | "(" expr ")"\nterm: /[0-9]+/', ["expr", "start"]),
    (gbnf_to_lark('root ::= "x" root'), ["start"]),
]
ENDING = [
    'start: a\na: "x" a | "y"',
    'start: a*\na: "x" a',
    'start: a?\na: "x" a',
    'start: [a]\na: "x" a',
    'start: a ~ 0..3\na: "x" a',
    'start: (a | "q")\na: "x" a',
    'start: item+\nitem: NUMBER | "(" start ")"\nNUMBER: /[0-9]+/',
    'start: expr\nexpr: expr "+" term\n    | term\nterm: /[0-9]+/',
    "%import common.NUMBER\nstart: NUMBER",
    'start: obj\nobj: %json {"type": "object", "properties": {"a": {"type": "string", "pattern": "}{"}}}',
    'start: /[^/]+/ "x"',
    '// a comment\nstart: "a".."z"+ // and another\n',
    'start: <|im_end|> | "x"',
    'start[stop="\\n"]: "x"*',
    '?start.2: "a" -> alias',
    gbnf_to_lark('root ::= "yes" | "no" | "maybe " root'),
    gbnf_to_lark('root ::= item+\nitem ::= [a-z] | "(" root ")"'),
]


@pytest.mark.parametrize(("text", "rules"), NEVER_ENDING)
def test_a_start_that_can_never_end_is_found(text, rules):
    assert never_ending_rules(text) == rules


@pytest.mark.parametrize("text", ENDING)
def test_grammars_that_can_end_are_not_refused(text):
    assert never_ending_rules(text) == []


def scaling_ratio(work: Callable[[str], object], small: str, large: str, repeats: int = 3) -> float:
    """How many times longer ``work(large)`` takes than ``work(small)``: each the fastest of ``repeats`` runs,
    alternated, so that a busy machine slows both alike and a moment's stall does not count."""
    best = {small: float("inf"), large: float("inf")}
    for _ in range(repeats):
        for text in (small, large):
            started = time.perf_counter()
            work(text)
            best[text] = min(best[text], time.perf_counter() - started)
    return best[large] / best[small]


def chain(length: int) -> str:
    """``start`` ends only through ``length`` rules, each ending only if the one it names does."""
    return f"start: r{length}\n" + "\n".join(f'r{i + 1}: "x" r{i}' for i in range(length)) + '\nr0: "end"'


def test_what_it_cannot_read_gets_no_verdict_and_hostile_sizes_stay_fast():
    assert never_ending_rules("start: weird & thing") is None  # not understood: left to llguidance
    assert never_ending_rules('other: "x"') is None  # no start rule
    assert never_ending_rules("start: " + "(" * 5000 + '"x"' + ")" * 5000) is None  # too deep to read here
    wide = "start: " + " ".join(f"r{i}" for i in range(3000)) + "\n"
    wide += "\n".join(f'r{i}: "x" r{i + 1}' for i in range(2999)) + '\nr2999: "e"'
    assert never_ending_rules(chain(3000)) == []  # settles in one walk whatever the order of its rules
    assert never_ending_rules(wide) in ([], None)  # no verdict rather than quadratic time


def test_a_chain_of_rules_is_settled_in_one_walk(monkeypatch):
    """The work counted, not timed: in a chain each rule is looked at twice at most (once before the rule it
    names is known to end, once after), so the items looked at stay within twice the grammar's size; a
    fixpoint that went over every rule until nothing changed would look at ~3000x the size."""
    visits = []
    real_ends = lark_base_case._ends

    def counted(body, rules, productive):
        visits.append(body)
        return real_ends(body, rules, productive)

    monkeypatch.setattr(lark_base_case, "_ends", counted)
    text = chain(3000)
    size = sum(lark_base_case._size(body) for body in lark_base_case._rules(lark_base_case._tokens(text)).values())
    assert never_ending_rules(text) == []
    assert 0 < len(visits) <= 2 * size, f"{len(visits)} items looked at for a grammar of {size}"


def test_a_grammar_that_can_never_end_is_a_parameter_error():
    with pytest.raises(InvalidParameter, match="the rules a, start can never end") as caught:
        StructuredOutputsParams(grammar='start: "y" a\na: "x" a | "z" a').to_grammar()
    assert caught.value.param == "structured_outputs"
    StructuredOutputsParams(grammar='start: "y" a\na: "x" a | "z"').to_grammar()


def test_random_grammars_get_the_verdict_of_a_direct_fixpoint():
    """Random rules of literals, regexes, groups, optionals and repeats: the verdict on their Lark text
    matches the productive-rules fixpoint computed on the structure they were written from."""
    rnd = random.Random(7)
    names = ["start", "a", "b", "c", "d"]
    atoms = ['"x"', "/[a-z]+/", '"a".."z"', '%json {"type": "integer"}', "<|im_end|>"]

    def item(depth: int) -> tuple:
        k = rnd.random()
        if k < 0.35:
            return ("ref", rnd.choice(names))
        if k < 0.55:
            return ("atom", rnd.choice(atoms))
        if depth < 2 and k < 0.8:
            return ("group" if k < 0.7 else "optional", [sequence(depth + 1) for _ in range(rnd.randrange(1, 3))])
        if k < 0.9:
            return ("postfix", rnd.choice("?*+"), item(depth + 1))
        return ("repeat", rnd.choice([0, 1, 2]), item(depth + 1))

    def sequence(depth: int) -> list:
        return [item(depth) for _ in range(rnd.randrange(1, 4))]

    def text(it: tuple) -> str:
        kind = it[0]
        if kind in ("ref", "atom"):
            return it[1]
        if kind in ("group", "optional"):
            inner = " | ".join(" ".join(text(i) for i in s) for s in it[1])
            return f"({inner})" if kind == "group" else f"[{inner}]"
        if kind == "postfix":
            return text(it[2]) + it[1]
        return f"{text(it[2])} ~ {it[1]}"

    def ends(it: tuple, productive: set[str]) -> bool:
        kind = it[0]
        if kind == "ref":
            return it[1] in productive
        if kind == "group":
            return any(all(ends(i, productive) for i in s) for s in it[1])
        if kind == "postfix":
            return it[1] in "?*" or ends(it[2], productive)
        if kind == "repeat":
            return it[1] == 0 or ends(it[2], productive)
        return True  # an atom, an optional

    verdicts = set()
    for _ in range(500):
        rules = {name: [sequence(0) for _ in range(rnd.randrange(1, 3))] for name in names}
        productive: set[str] = set()
        while True:
            new = {n for n, alts in rules.items() if any(all(ends(i, productive) for i in s) for s in alts)}
            if new == productive:
                break
            productive = new
        grammar = "\n".join(
            f"{name}: " + "\n    | ".join(" ".join(text(i) for i in s) for s in alts) for name, alts in rules.items()
        )
        verdict = never_ending_rules(grammar)
        assert verdict is not None and (verdict == []) == ("start" in productive), grammar
        verdicts.add(verdict == [])
    assert verdicts == {True, False}  # both kinds were drawn
