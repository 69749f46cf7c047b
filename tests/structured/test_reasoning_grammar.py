"""A structured output with a reasoning parser holds for the answer only: compiled by the engine's own
GrammarCompiler (probe included) for the default model's tokenizer, the grammar must accept exactly the
texts whose thinking follows the parser's rule and whose answer -- what the parser splits off -- is in the
client's language, and allow end-of-sequence only once the answer is whole."""

from __future__ import annotations

import pytest
import transformers

from pagedkv.entrypoints.server.reasoning import split_reasoning
from pagedkv.errors import InvalidParameter
from pagedkv.model.loader import model_directory
from pagedkv.structured import GrammarCompiler, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"(yes|no)!"),
    "choice": StructuredOutputsParams(choice=["red", "green"]),
    "grammar": StructuredOutputsParams(grammar='start: "x" NUM\nNUM: /[0-9]+/'),
}
ANSWERS = {  # (in the language, not in it)
    "json": ('{"a": 1}', '{"b": 1}'),
    "regex": ("yes!", "maybe!"),
    "choice": ("green", "blue"),
    "grammar": ("x42", "y42"),
}
THINKING = ["<think>\nLet me see: 1 < 2.\n</think>", "plan </thin k> then</think>", "<think></think>", ""]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(model_directory(None))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler, tokenizer, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens and then allows end-of-sequence (the answer is whole)."""
    matcher = compiler.compile(spec).deep_copy()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_the_grammar_constrains_the_answer_after_the_thinking(compiler, tokenizer, parser, kind):
    spec = StructuredOutputsParams(**{kind: getattr(SPECS[kind], kind)}, reasoning=parser)
    good, bad = ANSWERS[kind]
    for thinking in THINKING:
        opens = thinking.startswith("<think>")
        thinks_first = thinking != "" and (parser == "deepseek_r1" or opens)
        answers_at_once = thinking == "" and parser == "qwen3"
        assert accepts(compiler, tokenizer, spec, thinking + good) == (thinks_first or answers_at_once), thinking
        assert not accepts(compiler, tokenizer, spec, thinking + bad), thinking
        if thinks_first:
            assert split_reasoning(parser, thinking + good).content == good  # what the client gets is its answer
    assert not accepts(compiler, tokenizer, spec, "<think>never closed " + good)  # no end: no answer yet


def test_a_grammar_error_still_names_its_field_and_an_unknown_parser_is_refused(compiler):
    with pytest.raises(InvalidParameter, match="structured_outputs.grammar"):
        compiler.compile(StructuredOutputsParams(grammar="start: undefined_rule", reasoning="qwen3"))
    with pytest.raises(InvalidParameter, match="reasoning"):
        StructuredOutputsParams(json=SCHEMA, reasoning="granite")
