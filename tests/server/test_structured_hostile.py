"""Structured-output specs against a live server (issue 25 rows 3 and 4), loopback only, bounded in time.

Row 3: grammars compiled on the tokenizer worker, the thread that then also detokenized every stream, so eight
distinct ~55 KB schemas froze another client's stream for 11-24 s. Now they compile on a pool of their own:
a victim's stream moves on during every compile (checked as an order of events: each compile is held until
the victim got more tokens) and keeps its text, a compile past the time limit is a 400 naming the field and
the limit, answered while the compile still runs, and a spec is compiled once.

Row 4: specs that failed only inside an engine step (a 500, the reason in the log): JSON text nested ~1,000
levels, ``$ref`` cycles, a regex matching nothing, ``a{1000000}``, a choice of 2,000 strings, 600 optional
properties, Lark rules with no base case. Each is now a 400 naming the field before admission, no block is
held afterwards and the engine goes on serving.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.openai_server import build_app
from tests.live_server import live_server, wait_idle
from tests.victim_stream import VictimStream

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
VICTIM = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
VICTIM_TOKENS = 500  # ~7 s here: longer than the eight compiles


def cycle(*names: str) -> dict:
    """A schema whose $refs go round ``names`` and back, with nothing else: it matches no JSON at all."""
    defs = {a: {"$ref": f"#/$defs/{b}"} for a, b in zip(names, names[1:] + names[:1], strict=True)}
    return {"$ref": f"#/$defs/{names[0]}", "$defs": defs}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def large_schema(seed: int, size: int = 55_000) -> dict:
    """A distinct ~``size``-byte schema (its own property names): an anyOf of object variants, the shape
    that took longest to compile here (~0.08 s at 58 KB; patterns, enums and ranges were faster)."""
    variants, index = [], 0
    while len(json.dumps(variants)) < size - 600:
        properties = {f"s{seed}_v{index}_k{k}": {"type": "string", "maxLength": 12} for k in range(8)}
        variants.append({"type": "object", "properties": properties, "required": [f"s{seed}_v{index}_k0"]})
        index += 1
    return {"type": "object", "properties": {"answer": {"anyOf": variants}}, "required": ["answer"]}


HI = {"prompt": "hi", "max_tokens": 4}
HOSTILE_SPECS = {  # name: (body, the field a 400 must name)
    "json text nested 1000 deep": (HI | {"guided_json": "[" * 1000 + "]" * 1000}, "guided_json"),
    "json text nested objects": (
        HI | {"structured_outputs": {"json": '{"a": ' * 950 + "1" + "}" * 950}},
        "structured_outputs",
    ),
    "$ref cycle": (HI | {"response_format": json_schema(cycle("a", "b"))}, "response_format"),
    "$ref cycle of three": (HI | {"guided_json": cycle("x", "y", "z")}, "guided_json"),
    "$ref to itself": (HI | {"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs"),
    "regex matching nothing": (HI | {"guided_regex": r"[^\s\S]"}, "guided_regex"),
    "regex a{1000000}": (HI | {"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs"),
    "choice of 2001 strings": (HI | {"guided_choice": [f"option {i}" for i in range(2001)]}, "guided_choice"),
    "choice of 1001 strings": (HI | {"guided_choice": [f"o{i}" for i in range(1001)]}, "guided_choice"),
    "600 optional properties": (
        HI | {"response_format": json_schema({"type": "object", "properties": {f"p{i}": {} for i in range(600)}})},
        "response_format",
    ),
    "lark with no base case": (HI | {"guided_grammar": 'start: a\na: "x" a'}, "guided_grammar"),
    "lark left-recursive with no base case": (HI | {"guided_grammar": 'start: start "x"'}, "guided_grammar"),
    "lark rules only referring to each other": (
        HI | {"structured_outputs": {"grammar": "start: a\na: b\nb: a"}},
        "structured_outputs",
    ),
    "gbnf with no base case": (HI | {"guided_grammar": 'root ::= "x" root'}, "guided_grammar"),
    "lark whose every alternative recurses": (
        HI | {"guided_grammar": 'start: "y" a\na: "x" a\n | "z" a'},  # its first masks are fine: no probe sees it
        "guided_grammar",
    ),
    "tools with a $ref cycle": (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": cycle("p", "q")}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    "chat with a $ref cycle": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": json_schema(cycle("q"))},
        "response_format",
    ),
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=512, max_model_len=1024, num_threads=1))


@pytest.fixture(scope="module")
def server(engine: LLMEngine):
    app = build_app(engine, "smol")
    with live_server(app) as base_url:
        yield app, base_url


def assert_serving_and_idle(app, base_url: str) -> None:
    """A plain request is answered, and then no request, group or block is left."""
    resp = httpx.post(base_url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200, resp.text
    stats = wait_idle(app)
    assert stats["kv_blocks_used"] == 0 and not stats["num_requests_running"] and not stats["num_requests_waiting"]
    assert app.state.async_engine.num_in_flight == 0 and app.state.async_engine.num_sequences == 0
    assert not app.state.async_engine.engine.processor.groups


@pytest.mark.parametrize("name", list(HOSTILE_SPECS))
def test_a_spec_that_cannot_work_is_a_400_naming_its_field(server, name):
    app, base_url = server
    body, field = HOSTILE_SPECS[name]
    path = CHAT if "messages" in body else COMPLETIONS
    resp = httpx.post(base_url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and error["message"].startswith(field)  # the field the request used
    assert "structured_outputs" in error["message"] and len(error["message"]) < 1000  # its kind, and short
    assert "did not compile within" not in error["message"]  # refused by a check, not by the time limit
    assert_serving_and_idle(app, base_url)


def test_the_reasons_say_what_is_wrong(server):
    _, base_url = server
    expected = {
        "json text nested 1000 deep": "nests deeper than 64 levels",
        "$ref cycle": "matches no text",
        "regex matching nothing": "matches no text",
        "regex a{1000000}": "repetition",
        "choice of 2001 strings": "at most 1000",
        "600 optional properties": "too many alternatives",
        "lark with no base case": "base case",
        "gbnf with no base case": "base case",
        "lark whose every alternative recurses": "the rules a, start can never end",
    }
    for name, words in expected.items():
        body, _ = HOSTILE_SPECS[name]
        message = httpx.post(base_url + COMPLETIONS, json=body, timeout=60).json()["error"]["message"]
        assert words in message, (name, message)


def test_specs_at_the_edge_of_the_limits_are_served(server):
    """Just inside each bound: 1,000 choices, 400 optional properties, JSON text nested 60 levels; and GBNF."""
    app, base_url = server
    bodies = [
        HI | {"guided_choice": [f"o{i}" for i in range(1000)]},
        HI | {"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(400)}}},
        HI | {"guided_json": '{"type": "array", "items": ' * 59 + '{"type": "integer"}' + "}" * 59},
        HI | {"guided_grammar": 'root ::= "yes" | "no" | "maybe " root'},  # GBNF, recursive with a base case
        HI | {"guided_json": "[" * 30 + "{}" + "]" * 30},  # a schema that is a list: refused as a schema, not as deep
    ]
    statuses = [httpx.post(base_url + COMPLETIONS, json=body, timeout=60).status_code for body in bodies]
    assert statuses[:4] == [200, 200, 200, 200]
    resp = httpx.post(base_url + COMPLETIONS, json=bodies[4], timeout=60)
    assert resp.status_code == 400 and "nests deeper" not in resp.json()["error"]["message"]
    assert_serving_and_idle(app, base_url)


def counted_compiles(monkeypatch, compiler) -> list[str]:
    """Note every compile of ``compiler``; returns the list each compiled grammar is appended to."""
    real = compiler._compile
    grammars: list[str] = []

    def counted(grammar: str):
        grammars.append(grammar)
        return real(grammar)

    monkeypatch.setattr(compiler, "_compile", counted)
    return grammars


def compiles_waiting_for(monkeypatch, compiler, victim: VictimStream, events: int) -> list[bool]:
    """Make every compile of ``compiler`` wait, before it compiles, until ``victim`` got ``events`` more stream
    events (sleeping, which drops the GIL as llguidance does); returns the list each compile appends whether
    they came. Compiled on the thread that detokenizes every stream, a compile would wait for events that
    cannot come until it ends: they never come, however fast or slow the machine."""
    real = compiler._compile
    came: list[bool] = []

    def waiting(grammar: str):
        came.append(victim.is_alive() and victim.got_more(events))
        return real(grammar)

    monkeypatch.setattr(compiler, "_compile", waiting)
    return came


def test_large_schemas_compiling_do_not_stall_a_stream(server, monkeypatch):
    """Eight distinct large schemas arrive while a victim streams; each compile stays in progress until the
    victim got two more events, so the victim's stream must move on during every compile (counted, not
    timed), and its text is its text alone."""
    app, base_url = server
    alone = VictimStream(base_url, VICTIM, VICTIM_TOKENS)
    alone.start()
    alone.gaps()  # it finished, with its tokens: the reference text
    monkeypatch.setattr(app.state.async_engine.tokenizer.grammars, "timeout_s", 120.0)  # not what is tested here
    schemas = [large_schema(seed) for seed in range(8)]
    assert all(50_000 < len(json.dumps(s)) < 60_000 for s in schemas) and len({json.dumps(s) for s in schemas}) == 8
    statuses: list[int] = []

    def attacker(schema: dict) -> None:
        body = {"prompt": "Answer as JSON:", "max_tokens": 6, "temperature": 0, "response_format": json_schema(schema)}
        statuses.append(httpx.post(base_url + COMPLETIONS, json=body, timeout=600).status_code)

    victim = VictimStream(base_url, VICTIM, VICTIM_TOKENS)
    came = compiles_waiting_for(monkeypatch, app.state.async_engine.engine.grammars, victim, events=2)
    victim.start()
    assert victim.decoding.wait(60)
    attackers = [threading.Thread(target=attacker, args=(schema,)) for schema in schemas]
    for thread in attackers:
        thread.start()
    for thread in attackers:
        thread.join(600)
    assert len(came) == 8 and came == [True] * 8, f"the victim's stream stopped during compiles: {came}"
    assert statuses == [200] * 8
    victim.gaps()  # it finished, with its tokens
    assert "".join(victim.text) == "".join(alone.text)
    assert_serving_and_idle(app, base_url)


def held_compiles(monkeypatch, compiler, release: threading.Event, finished: threading.Event) -> list[float]:
    """Make every compile of ``compiler`` wait for ``release`` (60 s at most: only a test that failed
    elsewhere gets there) and set ``finished`` when it returns; returns the list each compile appends its
    start to. Whether an answer came while a compile was held is then an order of events, not a time."""
    real = compiler._compile
    starts: list[float] = []

    def held(grammar: str):
        starts.append(time.monotonic())
        release.wait(60)
        try:
            return real(grammar)
        finally:
            finished.set()

    monkeypatch.setattr(compiler, "_compile", held)
    return starts


def test_a_compile_past_the_time_limit_is_a_400_and_then_cached(server, monkeypatch):
    app, base_url = server
    pool = app.state.async_engine.tokenizer.grammars
    monkeypatch.setattr(pool, "timeout_s", 0.5)
    release, finished = threading.Event(), threading.Event()
    starts = held_compiles(monkeypatch, pool.compiler, release, finished)
    body = HI | {"guided_regex": "[a-c]{2,9}x"}
    cached = len(pool.compiler._cache)
    resp = httpx.post(base_url + COMPLETIONS, json=body, timeout=60)
    assert not finished.is_set(), "answered when the compile ended, not at the limit"
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "guided_regex"
    assert "did not compile within the limit of 0.5 s" in error["message"]
    release.set()  # the compile finishes anyway, and is cached
    deadline = time.monotonic() + 60  # only ends the test if it never is
    while len(pool.compiler._cache) == cached:
        assert time.monotonic() < deadline, "the compile nobody waited for was not cached"
        time.sleep(0.01)
    assert httpx.post(base_url + COMPLETIONS, json=body, timeout=60).status_code == 200
    assert len(starts) == 1
    assert_serving_and_idle(app, base_url)


def test_a_compile_that_cannot_start_in_time_is_a_503(server, monkeypatch):
    """With the one compile thread busy past the limit, the next spec waits the limit and is told to retry;
    its compile never runs."""
    app, base_url = server
    pool = app.state.async_engine.tokenizer.grammars
    monkeypatch.setattr(pool, "timeout_s", 0.4)
    release, finished = threading.Event(), threading.Event()
    starts = held_compiles(monkeypatch, pool.compiler, release, finished)
    results: dict[str, httpx.Response] = {}

    def post(name: str, regex: str) -> None:
        results[name] = httpx.post(base_url + COMPLETIONS, json=HI | {"guided_regex": regex}, timeout=60)

    first = threading.Thread(target=post, args=("first", "[d-f]{2,9}x"))
    first.start()
    while not starts:
        time.sleep(0.01)
    post("second", "[g-i]{2,9}x")
    first.join(60)
    assert not finished.is_set()  # both were answered while the first compile was still held
    assert results["first"].status_code == 400
    assert results["second"].status_code == 503 and "Retry-After" in results["second"].headers
    assert "grammar compiler is busy" in results["second"].json()["error"]["message"]
    release.set()
    pool._pool.submit(lambda: None).result(60)  # the one thread took its queue in order: the second's turn passed
    assert len(starts) == 1  # the second was dropped from the queue
    assert_serving_and_idle(app, base_url)


def test_the_same_spec_compiles_once(server, monkeypatch):
    app, base_url = server
    starts = counted_compiles(monkeypatch, app.state.async_engine.engine.grammars)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    bodies = [HI | {"guided_json": schema}, HI | {"response_format": json_schema(schema)}, HI | {"guided_json": schema}]
    assert [httpx.post(base_url + COMPLETIONS, json=b, timeout=60).status_code for b in bodies] == [200] * 3
    assert len(starts) == 1
    bad = HI | {"guided_regex": "b{1000000}"}
    assert [httpx.post(base_url + COMPLETIONS, json=bad, timeout=60).status_code for _ in range(2)] == [400] * 2
    assert len(starts) == 2  # a refusal is cached too
    assert_serving_and_idle(app, base_url)


def test_serve_options_size_the_grammar_pool(engine):
    """--grammar-compile-threads and --grammar-compile-timeout-s reach the pool the server compiles on."""
    from pagedkv.entrypoints.cli import build_parser
    from pagedkv.entrypoints.server.limits import ServerLimits

    args = build_parser().parse_args(["serve", "--grammar-compile-threads", "2", "--grammar-compile-timeout-s", "2.5"])
    limits = ServerLimits.from_args(args)
    pool = build_app(engine, "smol", limits=limits).state.async_engine.tokenizer.grammars
    assert pool.timeout_s == 2.5 and pool._pool._max_workers == 2
    default = build_app(engine, "smol").state.async_engine.tokenizer.grammars
    assert default.timeout_s == ServerLimits().grammar_compile_timeout_s and default._pool._max_workers == 1
    with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
        ServerLimits(grammar_compile_timeout_s=0)
