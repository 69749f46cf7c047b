"""The config transformers builds from a metadata-only copy of a GGUF file is the one it builds from the file.

The reference is transformers itself reading the whole file (its legacy reader, which the copy only spares the
vocabulary arrays), so these compare two runs of the same independent code on different inputs.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import transformers
from gguf import GGMLQuantizationType as T
from transformers import modeling_gguf_pytorch_utils as gguf_utils

from pagedkv.model import gguf_convert
from pagedkv.model.gguf_file import GGUFFile
from tests.tiny_gguf import save_tiny_gguf


def _config(path: Path) -> dict:
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    config.pop("tie_word_embeddings")  # inferred from the tensors; the loader decides it from the split set
    return config


def _check(path: Path, tmp_path: Path) -> None:
    whole = _config(path)
    original = gguf_utils.load_gguf_checkpoint
    with gguf_convert.config_reader_on_copy(path):
        assert gguf_utils.load_gguf_checkpoint is not original
        assert _config(path) == whole
    assert gguf_utils.load_gguf_checkpoint is original
    copy = tmp_path / "copy.gguf"
    gguf_convert.write_metadata_only(GGUFFile(path), copy)
    metadata = GGUFFile(copy).metadata
    assert not any(isinstance(v, list) and len(v) > gguf_convert._LARGE_ARRAY for v in metadata.values())
    assert metadata[f"{metadata['general.architecture']}.vocab_size"] == whole["vocab_size"]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "phi3"])
def test_a_tiny_files_config_is_the_same_from_the_copy(tmp_path, monkeypatch, architecture) -> None:
    """With the threshold lowered, the tiny vocabulary's arrays (512 tokens, merges) are left out and the
    vocabulary size comes from the copy's own entry."""
    monkeypatch.setattr(gguf_convert, "_LARGE_ARRAY", 64)
    path = save_tiny_gguf(tmp_path / f"{architecture}.gguf", T.Q8_0, architecture)
    assert any(isinstance(v, list) and len(v) > 64 for v in GGUFFile(path).metadata.values())
    _check(path, tmp_path)


def test_the_default_models_config_is_the_same_from_the_copy(tmp_path, default_model_path) -> None:
    path = Path(default_model_path)
    _check(path, tmp_path)
    copy = tmp_path / "copy.gguf"
    assert copy.stat().st_size < 64 * 1024  # the 49,152 tokens and their merges stay behind


def test_other_reads_go_to_the_file(tmp_path, monkeypatch) -> None:
    """Reads with tensors, or of another file, are passed through untouched."""
    path = save_tiny_gguf(tmp_path / "a.gguf", T.Q8_0)
    other = save_tiny_gguf(tmp_path / "b.gguf", T.Q8_0, seed=1)
    seen = []
    monkeypatch.setattr(
        gguf_utils, "load_gguf_checkpoint", lambda p, return_tensors=False, **kw: seen.append((str(p), return_tensors))
    )
    with gguf_convert.config_reader_on_copy(path):
        gguf_utils.load_gguf_checkpoint(str(path), return_tensors=True)
        gguf_utils.load_gguf_checkpoint(str(other))
        gguf_utils.load_gguf_checkpoint(str(path))
    assert seen[0] == (str(path), True) and seen[1] == (str(other), False)
    assert seen[2][0] != str(path) and seen[2][0].endswith("a.gguf")  # the copy, named as the file


def test_two_conversions_at_once_each_read_their_own_copy_and_leave_transformers_as_it_was(tmp_path, monkeypatch):
    """Two engines loading GGUF files at once in one process (two threads): each reads its own file's config,
    from its copy, and afterwards transformers' reader is its own again. Patched and restored by each without
    a lock, the first to finish put back the real reader under the other (which then read its whole file),
    and the other put back the first's, pointing at a deleted copy."""
    paths = [
        save_tiny_gguf(tmp_path / "llama.gguf", T.Q8_0, "llama"),
        save_tiny_gguf(tmp_path / "qwen2.gguf", T.Q8_0, "qwen2"),
    ]
    expected = [_config(path) for path in paths]
    assert expected[0] != expected[1]
    real = gguf_utils.load_gguf_checkpoint
    files = {str(path.resolve()) for path in paths}
    read_whole: list[str] = []  # config reads that went to a file instead of its copy

    def spied(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
        if str(Path(gguf_checkpoint_path).resolve()) in files:
            read_whole.append(str(gguf_checkpoint_path))
        return real(gguf_checkpoint_path, return_tensors, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", spied)
    rounds = 6
    start = threading.Barrier(2)
    got: list[list] = [[], []]
    errors: list[BaseException] = []

    def convert(i: int) -> None:
        start.wait()
        try:
            for _ in range(rounds):
                with gguf_convert.config_reader_on_copy(paths[i]):
                    got[i].append(_config(paths[i]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=convert, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert got == [[expected[0]] * rounds, [expected[1]] * rounds]
    assert not read_whole, f"{len(read_whole)} config reads went to the whole file, not its copy"
    assert gguf_utils.load_gguf_checkpoint is spied
