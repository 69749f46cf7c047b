"""The reasoning parser: the split of ``<think>...</think>`` from the answer, fed in any cuts (characters,
scripted token streams of two tokenizers: the tag as several tokens, and as one added token) against a
plain whole-text reference; then end to end, on a live server over the default model whose template (an
override) opens the thinking, so the model's own greedy output goes through the parser, streamed and not.
The same server refuses the fields it would not honour and keeps the ones clients send by default."""

from __future__ import annotations

import json
import random

import openai
import pytest
import transformers

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.openai_server import build_app
from pagedkv.entrypoints.server.reasoning import REASONING_PARSERS, ReasoningSplitter, split_reasoning
from pagedkv.model.loader import model_directory
from tests.live_server import live_server

PIECES = ["<think>", "</think>", "<", "</", "think", ">", "<th", "ink>", "</thi", "nk>", "a", "b c", "\n", "é", "x>"]
TEXTS = [
    "",
    "<think>",
    "<think></think>",
    "<think>plan</think>answer",
    "plan</think>answer",
    "<thi",
    "</think>",
    "no tags at all",
    "<think>open ended",
    "<think>a</think>b</think>c",
    " <think>late</think>x",
    "<think>\nstep 1\n</think>\n\nThe answer.",
]


def reference(parser: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole text, by the parsers' definitions, with plain string search."""
    if parser == "qwen3" and not text.startswith("<think>"):
        return "", text
    body = text.removeprefix("<think>")
    end = body.find("</think>")
    return (body, "") if end < 0 else (body[:end], body[end + len("</think>") :])


def streamed(parser: str, deltas: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser)
    parts = [splitter.feed(d) for d in deltas] + [splitter.finish()]
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


def random_cuts(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text), rng.randrange(0, 6))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("parser", REASONING_PARSERS)
def test_any_cut_of_any_text_splits_as_the_whole_text(parser):
    rng = random.Random(7)
    texts = TEXTS + ["".join(rng.choices(PIECES, k=rng.randrange(1, 10))) for _ in range(400)]
    for text in texts:
        expected = reference(parser, text)
        assert (split_reasoning(parser, text).reasoning, split_reasoning(parser, text).content) == expected, text
        assert streamed(parser, list(text)) == expected, text  # one character per delta
        for _ in range(5):
            assert streamed(parser, random_cuts(text, rng)) == expected, text


def token_deltas(tokenizer, text: str) -> list[str]:
    """The text deltas a stream of ``text``'s tokens carries: each token's new text, as decoded so far."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert decoded[-1] == text
    return [b[len(a) :] for a, b in zip(decoded, decoded[1:], strict=False)]


@pytest.mark.parametrize("tags_are_tokens", [False, True])
def test_scripted_token_streams_split_right(tags_are_tokens):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_directory(None))
    if tags_are_tokens:  # as in Qwen3's and DeepSeek-R1's vocabularies
        tokenizer.add_tokens(["<think>", "</think>"])
    outputs = ["<think>\nThe user asks for 2+2.\n</think>\n\n4", "Let me see</think>It is <b>4</b>.", "<think>cut off"]
    for text in outputs:
        deltas = token_deltas(tokenizer, text)
        assert ("</think>" in deltas) == (tags_are_tokens and "</think>" in text)  # one delta, or cut into several
        for parser in REASONING_PARSERS:
            assert streamed(parser, deltas) == reference(parser, text)


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningSplitter("granite")


# --- end to end -----------------------------------------------------------------------------------------

THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
# Two worked examples, so that the small default model writes its thinking, closes it and answers.
SHOTS = [
    {"role": "system", "content": "Think inside <think> </think>, then answer."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\n2 plus 2 is 4.\n</think>\nThe answer is 4."},
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "content": "<think>\n3 plus 3 is 6.\n</think>\nThe answer is 6."},
    {"role": "user", "content": "What is 5+5?"},
]
KEY, MAX_TOKENS = "r-key", 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    engine = LLMEngine(EngineConfig(num_kv_blocks=128, max_model_len=512, num_threads=1, chat_template=str(path)))
    app = build_app(engine, "smol", api_key=KEY, reasoning_parser="deepseek_r1")
    with live_server(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.mark.slow
def test_the_models_own_output_splits_streamed_and_not(server, client):
    ids = openai.OpenAI(base_url=server, api_key=KEY).post("/tokenize", body={"messages": SHOTS}, cast_to=object)
    raw = client.completions.create(model="smol", prompt=ids["tokens"], max_tokens=MAX_TOKENS, temperature=0)
    raw_text = raw.choices[0].text
    assert "</think>" in raw_text  # the examples work: the split happens inside the output
    reasoning, content = reference("deepseek_r1", raw_text)

    whole = client.chat.completions.create(model="smol", messages=SHOTS, max_tokens=MAX_TOKENS, temperature=0)
    message = whole.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)

    chunks = client.chat.completions.create(
        model="smol", messages=SHOTS, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    got_reasoning, got_content, deltas = "", "", 0
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            got_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            got_content += delta.content or ""
            deltas += 1
    assert (got_reasoning, got_content) == (reasoning, content)
    assert deltas > 3  # streamed in pieces, not in one delta at the end


@pytest.mark.slow
def test_a_structured_output_constrains_the_answer_after_the_thinking(client):
    free = client.chat.completions.create(model="smol", messages=SHOTS, max_tokens=MAX_TOKENS, temperature=0)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    formats = {
        "type": "json_schema",
        "json_schema": {"name": "sum", "schema": schema | {"additionalProperties": False}},
    }
    reply = client.chat.completions.create(
        model="smol", messages=SHOTS, max_tokens=MAX_TOKENS, temperature=0, response_format=formats
    )
    message = reply.choices[0].message
    # The thinking is the model's own (every token of it was allowed); only the answer had to change.
    assert message.model_extra["reasoning_content"] == free.choices[0].message.model_extra["reasoning_content"]
    answer = json.loads(message.content)
    assert list(answer) == ["answer"] and isinstance(answer["answer"], int)
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_forced_tool_calls_follow_the_thinking(client):
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
    reply = client.chat.completions.create(
        model="smol",
        messages=SHOTS,
        max_tokens=120,
        temperature=0,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"]
    assert [call.function.name for call in message.tool_calls] == ["add"]
    assert reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", "low"),
        ("logit_bias", {"5": 10}),
        ("store", True),
        ("service_tier", "flex"),
        ("continue_final_message", True),
        ("add_generation_prompt", False),
        ("use_beam_search", True),
        ("chat_template", "{{ messages }}"),
        ("enable_thinking", False),  # a template variable belongs in chat_template_kwargs
    ],
)
def test_fields_not_honoured_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smol", messages=SHOTS, max_tokens=2, extra_body={field: value})
    assert refused.value.body["param"] == field and field in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="smol", prompt="Hi", max_tokens=2, extra_body={field: value})
    assert refused.value.body["param"] == field


@pytest.mark.slow
def test_a_stream_option_not_honoured_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="smol", messages=SHOTS, max_tokens=2, stream=True, stream_options={"continuous_usage_stats": True}
        )
    assert refused.value.body["param"] == "stream_options.continuous_usage_stats"


@pytest.mark.slow
def test_the_defaults_clients_send_are_accepted(client):
    defaults = {"store": False, "service_tier": "auto", "modalities": ["text"], "user": "u-1", "metadata": {"k": "v"}}
    reply = client.chat.completions.create(model="smol", messages=SHOTS, max_tokens=2, extra_body=defaults)
    assert reply.choices[0].finish_reason == "length"
    text = client.completions.create(model="smol", prompt="Hi", max_tokens=2, user="u-1")
    assert text.choices[0].finish_reason in ("length", "stop")
