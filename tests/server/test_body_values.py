"""The count of a request body's JSON values, taken from its bytes before it is parsed (issue 25, row 2).

``json.loads`` holds the GIL for a whole body: ~1M tiny containers in 4 MiB held it 0.15-0.4 s, a gap in
every stream. ``count_json_values`` counts without building them, so it must be right for any text a
parser would get far into: strings (with escapes, commas and brackets in them) are not counted, other
encodings are counted as what they decode to, and a refusal names ``--max-json-values``.
"""

from __future__ import annotations

import json
import random

import pytest

from pagedkv.entrypoints.server.limits import OTHER_VALUES, ServerLimits, count_json_values
from pagedkv.entrypoints.server.protocol import APIError


def reference_count(text: str) -> int:
    """1 + the , [ { outside strings, one character at a time."""
    count, in_string, escaped = 1, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in ",[{":
            count += 1
    return count


def values(value) -> int:
    """Array items and object members (each counted once, an empty container twice), + 1."""
    if isinstance(value, list | dict):
        items = list(value.values() if isinstance(value, dict) else value)
        return 1 + (not items) + sum(values(v) for v in items)
    return 1


def random_value(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if depth < 4 and pick < 0.3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 4 and pick < 0.5:
        return {rng.choice(["a", "b,", "[{", '"\\"']): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if pick < 0.85:
        return "".join(rng.choice('ab,[{]}"\\\u00e9\n\U0001f600') for _ in range(rng.randrange(6)))
    return rng.choice([rng.randrange(100), 1.5, None, True])


def test_the_count_is_exact_outside_strings_in_every_encoding():
    rng = random.Random(25)
    for _ in range(2000):
        value = random_value(rng)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
        expected = reference_count(text)
        assert expected == values(value)
        assert count_json_values(text.encode()) == expected, text
        assert count_json_values(b"\xef\xbb\xbf" + text.encode()) == expected
        for encoding in ("utf-16", "utf-16-le", "utf-32-be"):
            # json.loads takes these too; an escaped quote (\ \0 " \0) must not end a string
            assert count_json_values(text.encode(encoding)) == expected, encoding


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi", "user": [' + b",".join([b"[]"] * 200_000) + b"]}",
        b'{"prompt": "hi", "user": {"a": [' + b",".join([b"{}"] * 200_000) + b"]}}",
        b'{"prompt": [' + b",".join([b"0"] * 200_000) + b"]}",
        b'{"user": [' + b",".join([b'","'] * 200_000) + b"]}",  # many strings, each with a comma
        b'{"user": "\\"", "x": [' + b",".join([b"[]"] * 200_000) + b"]}",  # an escaped quote
        json.dumps({"user": "\\", "x": [[]] * 200_000}).encode("utf-16"),
        b'{"user": [' + b",".join([b"[]"] * 200_000) + b"] \\ garbage",  # not JSON, but only at the end
    ],
)
def test_a_body_of_many_values_is_refused_before_parsing(raw):
    limits = ServerLimits(max_json_values=100_000)
    with pytest.raises(APIError) as refused:
        limits.check_values(raw, max_model_len=1024)
    assert refused.value.status == 413 and refused.value.code == "limit_exceeded"
    assert "(--max-json-values)" in refused.value.message and "100000" in refused.value.message


def test_real_requests_pass_the_default():
    """The default is a full batch of token-id prompts at max_model_len plus OTHER_VALUES for the rest; long
    texts full of commas and brackets are one value each."""
    limits = ServerLimits()
    batch = {"prompt": [list(range(1024))] * limits.max_prompts, "stop_token_ids": list(range(1024))}
    limits.check_values(json.dumps(batch).encode(), max_model_len=1024)
    text = 'a, [b], {c}, \\"d\\", ' * 200_000
    chat = {"messages": [{"role": "user", "content": text}] * 2, "tools": [{"a": [1, 2]}] * 4000}
    limits.check_values(json.dumps(chat).encode(), max_model_len=1024)
    over = {"prompt": [list(range(1024))] * limits.max_prompts, "user": [0] * (OTHER_VALUES + 1)}
    with pytest.raises(APIError, match="max-json-values"):
        limits.check_values(json.dumps(over).encode(), max_model_len=1024)


def test_the_option_sets_the_limit():
    from pagedkv.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-json-values", "5000"])
    assert ServerLimits.from_args(args).max_json_values == 5000
    assert ServerLimits.from_args(build_parser().parse_args(["serve"])).max_json_values is None
    with pytest.raises(ValueError, match="max_json_values"):
        ServerLimits(max_json_values=0)
