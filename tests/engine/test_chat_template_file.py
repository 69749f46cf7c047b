"""--chat-template FILE: a file that cannot be used stops `pagedkv serve` (and LLM) before the model loads,
with the file and the problem named; a good one is what /tokenize and chat render (test_tokenize_routes)."""

from __future__ import annotations

import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.chat_templates import ChatTemplateError, load_chat_template
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints import cli

BAD_FILES = [  # (content or None for no file, what the error says)
    (b"{% for m in messages %}{{ m.content }\n", "line 1"),
    (b"ok\n{% if x %}never closed", "line 2"),
    (b"\xff\xfe{{ x }}", "not UTF-8"),
    (b"  \n", "empty"),
    (None, "cannot be read"),
]


@pytest.mark.parametrize(("content", "expected"), BAD_FILES)
def test_a_bad_template_file_stops_serve_with_a_clear_error(tmp_path, capsys, content, expected):
    path = tmp_path / "template.jinja"
    if content is not None:
        path.write_bytes(content)
    assert cli.main(["serve", "--chat-template", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and expected in err and "Traceback" not in err
    with pytest.raises(ChatTemplateError, match=expected):
        LLMEngine(EngineConfig(chat_template=str(path)))


def test_a_good_file_is_read_whole_and_generate_keeps_its_flag(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(path) == path.read_text()
    args = cli.build_parser().parse_args(["generate", "--chat-template", "Hello"])
    assert args.chat and args.prompts == ["Hello"] and "chat_template" not in cli.engine_kwargs(args)
    serve = cli.build_parser().parse_args(["serve", "--chat-template", str(path), "--reasoning-parser", "qwen3"])
    assert cli.engine_kwargs(serve)["chat_template"] == str(path) and serve.reasoning_parser == "qwen3"
