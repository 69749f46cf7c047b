"""ServerLimits: every bound the server puts on a request, each checked before any work is done for it.

A request body that passes JSON parsing can still cost the server far more than its size suggests: a
million samples (``n``), half a million stop strings scanned after every token, a 4 MiB prompt tokenized
before it is found too long, or a list of 100 k bad items that a validator turns into 300 k error objects.
Even parsing costs: ``json.loads`` holds the GIL for the whole body, and a 4 MiB body of ~1M tiny containers
(``[[],[],...]``) held it 0.15-0.4 s, a gap in every stream. So ``check_values`` counts the body's values in
its raw bytes before it is parsed (a few C-speed passes, no Python object per value), ``check_shape`` then
walks the parsed JSON once (depth and list lengths), and ``ServerLimits.check`` bounds the fields whose cost
grows with their value. Each limit is a server option
(``pagedkv serve --help``) and its error is a 400 that names the field and the option.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from pagedkv.entrypoints.server.openai_requests import GRAMMAR_FIELDS
from pagedkv.entrypoints.server.protocol import APIError

# Values a request needs besides its prompts' token ids, at most: 64 KiB of tools or grammar as JSON hold
# at most ~32 k (two bytes a value), stop_token_ids 1,024, messages 512 (with their content parts).
OTHER_VALUES = 65_536
_QUOTE, _BACKSLASH = b'"', b"\\"
_NOT_COUNTED = bytes(sorted(set(range(256)) - set(b'",[{')))  # translate() deletes these: left are " , [ {


def option(default: float | None, help: str) -> Any:
    """A limit's default and the help of its ``pagedkv serve`` option."""
    return field(default=default, metadata={"help": help})


L = TypeVar("L", bound="CliLimits")


class CliLimits:
    """Limits that must be > 0 (None where allowed means "derived"), each set by a ``--max-n``-style option of
    ``pagedkv serve`` with the field's default and help (a ``_s`` field takes seconds, a float)."""

    __slots__ = ()
    ARGUMENT_GROUP: ClassVar[str]
    HELP_SHOWS_DEFAULT: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value!r}")

    @classmethod
    def from_args(cls: type[L], args: argparse.Namespace) -> L:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group(cls.ARGUMENT_GROUP)
        for f in fields(cls):
            kind = float if f.name.endswith("_s") else int
            help_text = f"{f.metadata['help']} (default: {f.default})" if cls.HELP_SHOWS_DEFAULT else f.metadata["help"]
            group.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=help_text)


@dataclass(slots=True)
class ServerLimits(CliLimits):
    """Per-request bounds. ``max_prompt_chars=None`` means 32 characters per token of context: a token of
    this kind of tokenizer is rarely longer, so a longer prompt could not fit and tokenizing it is waste."""

    ARGUMENT_GROUP = "request limits (each exceeded limit is a 400 naming it)"
    max_n: int = option(128, "samples per prompt (n)")
    max_prompts: int = option(64, "prompts in one completions request")
    max_stop_strings: int = option(32, "stop strings per request")
    max_stop_string_chars: int = option(256, "characters per stop string")
    max_stop_token_ids: int = option(1024, "stop_token_ids per request")
    max_prompt_chars: int | None = option(
        None, "prompt characters, checked before tokenizing (default: 32 x max_model_len)"
    )
    max_messages: int = option(512, "chat messages per request")
    max_list_items: int = option(4096, "items of any other list in a request body")
    max_json_depth: int = option(32, "nesting depth of a request body")
    max_json_values: int | None = option(
        None,
        "JSON values in a request body, counted before parsing as the commas, [ and { outside strings "
        f"(default: max_prompts x max_model_len + {OTHER_VALUES}: a full batch of token-id prompts and the rest)",
    )
    max_grammar_bytes: int = option(
        64 * 1024, "bytes of a structured-output spec (JSON schema, regex, choices, grammar) or of tools, as JSON"
    )
    max_queued_seqs: int = option(256, "sequences (n x prompts) queued or running; past it: 503 + Retry-After")
    stream_stall_timeout_s: float = option(
        30.0, "seconds a streaming client may read nothing before its request is aborted"
    )
    max_stored_responses: int = option(
        1024, "responses kept for previous_response_id (/v1/responses), least recently used dropped first"
    )
    max_stored_response_bytes: int = option(
        64 * 2**20, "bytes of the responses kept for previous_response_id, as JSON (conversation and response)"
    )
    grammar_compile_threads: int = option(
        1, "threads compiling structured-output specs, apart from the engine and stream delivery"
    )
    grammar_compile_timeout_s: float = option(
        10.0,
        "seconds a structured-output spec may wait for a compile thread (then 503 + Retry-After) and then "
        "compile (then a 400 naming the field; the compile finishes and is cached)",
    )

    def check(self, body: dict[str, Any], max_model_len: int) -> None:
        """The field-specific bounds, on the raw JSON (before pydantic builds anything from it)."""
        n = body.get("n")
        if isinstance(n, int) and n > self.max_n:
            raise _limit("n", f"n is {n} but this server allows at most {self.max_n}", "max_n")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > self.max_stop_strings:
            raise _limit("stop", f"{len(stops)} stop strings, at most {self.max_stop_strings}", "max_stop_strings")
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        if longest > self.max_stop_string_chars:
            raise _limit(
                "stop",
                f"a stop string has {longest} characters, at most {self.max_stop_string_chars}",
                "max_stop_string_chars",
            )
        stop_ids = body.get("stop_token_ids")
        if isinstance(stop_ids, list) and len(stop_ids) > self.max_stop_token_ids:
            raise _limit(
                "stop_token_ids",
                f"{len(stop_ids)} stop token ids, at most {self.max_stop_token_ids}",
                "max_stop_token_ids",
            )
        self._check_prompt(body, max_model_len)
        tokens = body.get("tokens")
        if isinstance(tokens, list) and len(tokens) > max_model_len:
            message = f"{len(tokens)} token ids but max_model_len is {max_model_len}"
            raise _limit("tokens", message, "max_model_len")
        for name in (*GRAMMAR_FIELDS, "tools"):  # tools become a grammar too
            self.check_spec(name, body.get(name))

    def check_spec(self, name: str, spec: Any) -> None:
        """A structured-output spec or tool list, as JSON, within ``max_grammar_bytes``."""
        if spec is not None and len(json.dumps(spec)) > self.max_grammar_bytes:
            raise _limit(name, f"{name} is larger than {self.max_grammar_bytes} bytes", "max_grammar_bytes")

    def check_conversation(self, param: str, messages: int, chars: int, max_model_len: int) -> None:
        """A prompt's messages and characters, before it is tokenized; also for a conversation that a route
        assembles from more than one field (the Responses API: a stored conversation, input, instructions)."""
        if messages > self.max_messages:
            raise _limit(param, f"{messages} messages, at most {self.max_messages}", "max_messages")
        limit = self.max_prompt_chars or 32 * max_model_len
        if chars > limit:
            raise _limit(param, f"the prompt text has {chars} characters, at most {limit}", "max_prompt_chars")

    def _check_prompt(self, body: dict[str, Any], max_model_len: int) -> None:
        prompt, messages = body.get("prompt"), body.get("messages")
        if isinstance(prompt, list):
            if prompt and isinstance(prompt[0], list | str) and len(prompt) > self.max_prompts:
                raise _limit("prompt", f"{len(prompt)} prompts, at most {self.max_prompts}", "max_prompts")
            token_lists = [p for p in prompt if isinstance(p, list)] or [prompt]
            longest = max(len(p) for p in token_lists)
            if longest > max_model_len:
                raise _limit(
                    "prompt", f"a prompt has {longest} token ids but max_model_len is {max_model_len}", "max_model_len"
                )
        count = len(messages) if isinstance(messages, list) else 0
        param = "messages" if messages is not None else "prompt"
        self.check_conversation(param, count, _text_chars(prompt) + _text_chars(messages), max_model_len)

    def check_values(self, raw: bytes, max_model_len: int) -> None:
        """The body's JSON values, counted in its bytes before ``json.loads`` builds an object for each.

        Parsing holds the GIL throughout: 1.3 M ``[]`` took 0.22 s, 2 M token ids 0.14 s, 1 M floats 0.19 s
        (4 MiB each), while a real request with the most values, ``max_prompts`` prompts of ``max_model_len``
        token ids each, has at most the default limit. The count, ``count_json_values``, is 1 + the commas,
        ``[`` and ``{`` outside strings: every array item or object member but a container's first follows a
        comma, and the first follows its container's opener, so no body has more values than that.
        """
        limit = self.max_json_values or self.max_prompts * max_model_len + OTHER_VALUES
        if len(raw) < limit:  # each counted byte is one of the body's
            return
        values = count_json_values(raw, limit)
        if values > limit:
            message = f"the body holds more than {limit} JSON values (at least {values})"
            raise _limit(None, message, "max_json_values", status=413)  # no one field exceeds it: as for the bytes

    def check_shape(self, body: Any) -> None:
        """Depth and list lengths of the whole parsed body, iteratively (a deep body cannot overflow the stack).

        ``prompt`` and /detokenize's ``tokens`` may hold token-id lists up to ``max_model_len``; their bounds
        are checked by ``check``.
        """
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        stack: list[tuple[Any, int, str]] = [(v, 1, k) for k, v in body.items()]
        while stack:
            value, depth, path = stack.pop()
            if depth > self.max_json_depth:
                raise _limit(path, f"{path} nests deeper than {self.max_json_depth} levels", "max_json_depth")
            if isinstance(value, str):
                _check_text(value, path)
            elif isinstance(value, dict):
                stack.extend((v, depth + 1, path) for v in value.values())
            elif isinstance(value, list):
                if path not in ("prompt", "tokens") and len(value) > self.max_list_items:
                    message = f"{path} has {len(value)} items, at most {self.max_list_items}"
                    raise _limit(path, message, "max_list_items")
                stack.extend((v, depth + 1, path) for v in value if isinstance(v, str | dict | list))


def count_json_values(raw: bytes, limit: int | None = None) -> int:
    """1 + the ``,``, ``[`` and ``{`` bytes of a JSON text outside its strings: at least its number of values.

    Once past ``limit`` the count may stop early: the answer is then only more than ``limit``. The common
    case is three ``bytes.count`` passes; strings are taken out only when the bytes themselves are over the
    limit (a long text with many commas): escapes removed (``\\\\`` then ``\\"``, as JSON pairs them), every
    byte but ``" , [ {`` deleted, strings left with none of those (two adjacent quotes) removed, and what is
    between the remaining quote pairs not counted. In UTF-8 no byte of a multi-byte character is ASCII, so
    this works on the bytes; a body in UTF-16 or UTF-32 (``json.loads`` takes those) is transcoded first.
    For a text that is not valid JSON the count is right up to its first error, where parsing stops.
    """
    encoding = json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):
        raw = raw.decode(encoding, errors="replace").encode("utf-8", errors="replace")
    total = 1 + raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if limit is not None and total <= limit:
        return total
    if _BACKSLASH in raw:  # escapes only occur in strings; after these two no quote is left but the strings' own
        raw = raw.replace(_BACKSLASH + _BACKSLASH, b"").replace(_BACKSLASH + _QUOTE, b"")
    kept = raw.translate(None, _NOT_COUNTED).replace(_QUOTE + _QUOTE, b"")
    quotes = kept.count(_QUOTE)
    if quotes == 0:
        return 1 + len(kept)
    if limit is not None and quotes > 4 * limit:
        # Each quote pair left is one or more strings, and each value holds at most two (a member's key and
        # value): more than 4 x limit quotes are more than limit values, known without splitting them apart
        return max(limit + 1, -(-quotes // 4))
    parts = kept.split(_QUOTE)
    return 1 + sum(map(len, parts[::2]))


def _check_text(text: str, path: str) -> None:
    """JSON may escape a lone surrogate ("\\ud800"), which is no text: the tokenizer, the prefix-cache hash
    and the response encoder would each fail on it later, so it is refused here, naming the field."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(
                400,
                f"{path} holds a lone surrogate (\\u{ord(exc.object[exc.start]):04x}), which is not text",
                param=path,
            ) from exc


def _text_chars(value: Any) -> int:
    """Characters of prompt text: a string, a list of strings, or chat messages' text content."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, list):
        return 0
    total = 0
    for item in value:
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):  # a chat message, or one text part of a message's content
            total += _text_chars(item.get("content")) + _text_chars(item.get("text"))
    return total


def _limit(param: str | None, message: str, option: str, status: int = 400) -> APIError:
    flag = "--" + option.replace("_", "-")
    return APIError(status, f"{message}: this server's limit ({flag})", param=param, code="limit_exceeded")
