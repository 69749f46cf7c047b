"""Routing keys: a request body -> its prompt's block keys (what the replica's cache will look up) or text."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from pagedkv.engine.prompts import render_chat
from pagedkv.entrypoints.replicas.routing_keys import MAX_KEYED_BODY_BYTES, RoutingKeys
from pagedkv.kv.hashing import extend_block_keys
from tests.tiny_model import save_tiny_llama

BLOCK = 4
TEXT = " ".join(f"w{i}" for i in range(10, 23))  # 13 words: 3 full blocks and one token
TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(save_tiny_llama(tmp_path_factory.mktemp("tiny")))
    tok.chat_template = TEMPLATE
    return tok


def keys_of(ids: list[int], salt: str | None = None) -> tuple[bytes, ...]:
    out: list[bytes] = []
    extend_block_keys(out, ids, BLOCK, salt)
    return tuple(out)


def body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def test_completions_keys_are_the_engines_block_keys(tokenizer):
    router = RoutingKeys(tokenizer, BLOCK, "block_keys")
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    key = router.of("POST", "/v1/completions", body(prompt=TEXT))
    assert len(key.block_keys) == 3 and key.block_keys == keys_of(ids)
    assert router.of("POST", "/v1/completions", body(prompt=ids)).block_keys == keys_of(ids)
    batch = router.of("POST", "/v1/completions", body(prompt=[TEXT, "w1 w2"]))
    assert batch.block_keys == keys_of(ids)  # a batch goes where its first prompt's prefix is


def test_the_cache_salt_is_in_every_key(tokenizer):
    router = RoutingKeys(tokenizer, BLOCK, "block_keys")
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    salted = router.of("POST", "/v1/completions", body(prompt=TEXT, cache_salt="tenant-1")).block_keys
    other = router.of("POST", "/v1/completions", body(prompt=TEXT, cache_salt="tenant-2")).block_keys
    assert salted == keys_of(ids, "tenant-1")
    assert not set(salted) & set(other) and not set(salted) & set(keys_of(ids))


def test_chat_keys_follow_the_chat_template(tokenizer):
    router = RoutingKeys(tokenizer, BLOCK, "block_keys")
    messages = [{"role": "system", "content": TEXT}, {"role": "user", "content": "w7 w8"}]
    key = router.of("POST", "/v1/chat/completions", body(messages=messages))
    assert key.block_keys == keys_of(render_chat(tokenizer, messages)) and len(key.block_keys) == 5


def test_what_is_not_a_request_gets_no_key_but_a_text(tokenizer):
    router = RoutingKeys(tokenizer, BLOCK, "block_keys")
    for method, path, raw in [
        ("GET", "/v1/models", b""),
        ("POST", "/v1/completions", b"{not json"),
        ("POST", "/v1/completions", body(prompt=TEXT, n="many")),
        ("POST", "/v1/embeddings", body(input=TEXT)),
        ("POST", "/v1/completions", body(prompt="w1 " * MAX_KEYED_BODY_BYTES)),
    ]:
        key = router.of(method, path, raw)
        assert key.block_keys == () and key.text == f"{method} {path}"


def test_the_text_kind_gives_the_salted_prompt(tokenizer):
    router = RoutingKeys(tokenizer, BLOCK, "text")
    assert router.of("POST", "/v1/completions", body(prompt=TEXT)).text == TEXT
    assert router.of("POST", "/v1/completions", body(prompt=TEXT, cache_salt="s")).text == f"s\n{TEXT}"
    assert router.of("POST", "/v1/completions", body(prompt=[5, 6])).text == "5 6"
    chat = router.of("POST", "/v1/chat/completions", body(messages=[{"role": "user", "content": "w9"}]))
    assert chat.text == "w1 w9 w2 w5" and chat.block_keys == ()
    assert router.of("POST", "/v1/completions", body(prompt="")).text == "POST /v1/completions"


def test_unknown_kinds_are_refused(tokenizer):
    with pytest.raises(ValueError, match="kind"):
        RoutingKeys(tokenizer, BLOCK, "tokens")


@pytest.mark.parametrize("kind", ["block_keys", "text"])
def test_messages_the_template_refuses_get_no_key(tokenizer, kind):
    """The replica answers these with a 400; the ingress must route them by load, not fail with a 500."""
    refusing = copy.copy(tokenizer)
    refusing.chat_template = "{{ raise_exception('roles must alternate') }}"
    router = RoutingKeys(refusing, BLOCK, kind)
    key = router.of("POST", "/v1/chat/completions", body(messages=[{"role": "user", "content": "w9"}]))
    assert key.block_keys == () and key.text == "POST /v1/chat/completions"
