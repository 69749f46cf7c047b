"""Structured outputs on the default model: every output parses and validates against its schema (checked by
``jsonschema``, independently of the grammar library), regexes and choices match, drafts and neighbours
change nothing they should not, and bad grammars are refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.structured import StructuredOutputsParams

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "city": NAME,
            "country": {
                "type": "object",
                "properties": {"name": NAME, "code": {"enum": ["FR", "IT", "JP"]}},
                "required": ["name", "code"],
                "additionalProperties": False,
            },
            "population": {"type": "integer", "minimum": 1000, "maximum": 40000000},
        },
        "required": ["city", "country", "population"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "fruits": {
                "type": "array",
                "minItems": 2,
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"name": NAME, "colour": {"enum": ["red", "yellow", "green"]}},
                    "required": ["name", "colour"],
                    "additionalProperties": False,
                },
            },
            "note": NAME,  # optional
        },
        "required": ["fruits"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "answer": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"enum": ["unknown"]}]},
            "sure": {"type": "boolean"},
        },
        "required": ["answer", "sure"],
        "additionalProperties": False,
    },
}
QUESTION = [{"role": "user", "content": "Give me some facts about a place or some fruit, as JSON."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=512, max_model_len=1024)


def _chat(llm: LLM, params: list[SamplingParams]) -> list:
    return llm.chat([QUESTION] * len(params), params, use_tqdm=False)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_parse_and_validate_greedy_and_sampled(llm, name):
    schema = SCHEMAS[name]
    params = [SamplingParams(max_tokens=300, temperature=0, structured_outputs={"json": schema})] + [
        SamplingParams(max_tokens=300, temperature=1.0, seed=seed, structured_outputs={"json": schema})
        for seed in range(4)
    ]
    for out in _chat(llm, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_regex_and_choice(llm):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["Paris", "Rome", "Tokyo", "somewhere else"]
    outs = _chat(
        llm,
        [
            SamplingParams(max_tokens=200, temperature=0.7, seed=1, structured_outputs={"json_object": True}),
            SamplingParams(max_tokens=20, temperature=0.9, seed=2, structured_outputs={"regex": phone}),
            SamplingParams(max_tokens=20, temperature=0.9, seed=3, structured_outputs={"choice": choices}),
            SamplingParams(
                max_tokens=20, temperature=0, structured_outputs={"grammar": 'start: "yes" | "no" | "maybe"'}
            ),
        ],
    )
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(phone, outs[1].text)
    assert outs[2].text in choices
    assert outs[3].text in ("yes", "no", "maybe")
    assert all(o.finish_reason == "stop" for o in outs)


def test_unconstrained_neighbours_and_drafts_change_nothing(llm):
    plain = SamplingParams(max_tokens=24, temperature=0)
    shaped = SamplingParams(max_tokens=200, temperature=0, structured_outputs={"json": SCHEMAS["array"]})
    alone_plain = _chat(llm, [plain])[0].token_ids
    alone_shaped = _chat(llm, [shaped])[0].token_ids
    mixed = _chat(llm, [plain, shaped, plain, shaped])
    assert [o.token_ids for o in mixed] == [alone_plain, alone_shaped] * 2
    speculative = LLM(num_kv_blocks=512, max_model_len=1024, num_speculative_tokens=4)
    assert _chat(speculative, [shaped])[0].token_ids == alone_shaped
    assert speculative.stats()["draft_tokens"] > 0


def test_max_tokens_inside_a_structure_cuts_it_with_length(llm):
    out = _chat(llm, [SamplingParams(max_tokens=5, temperature=0, structured_outputs={"json": SCHEMAS["nested"]})])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.mark.parametrize(
    "spec",
    [{"json": {"type": "nonsense"}}, {"regex": "("}, {"grammar": "start: (("}, {"json": "{not json"}],
)
def test_bad_grammars_are_refused_naming_the_field_and_nothing_leaks(llm, spec):
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_compiled_grammars_are_cached_by_content(llm):
    spec = SamplingParams(structured_outputs={"json": SCHEMAS["array"]}).structured_outputs
    first = llm.engine.grammars.matcher(spec)
    cached = len(llm.engine.grammars._cache)
    second = llm.engine.grammars.matcher(spec)
    assert len(llm.engine.grammars._cache) == cached and first is not second  # one template, fresh copies


def test_json_may_be_pretty_printed_but_whitespace_runs_are_bounded(llm):
    def accepts(text: str) -> bool:
        matcher = llm.engine.grammars.matcher(StructuredOutputsParams(json_object=True))
        ids = llm.engine.encode(text)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    assert accepts('{"a": [1, 2]}') and accepts('{\n    "a": [\n        1\n    ]\n}')
    assert not accepts("{" + "\n" * 40 + '"a": 1}')  # a model stuck on newlines is stopped
