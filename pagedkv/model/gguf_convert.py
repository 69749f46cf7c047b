"""A GGUF file's config read by transformers in a fraction of a second, not seconds.

transformers reads the config of most architectures (Llama, Qwen2, Gemma 3, ...) with its legacy GGUF reader,
``load_gguf_checkpoint``, which parses *every* metadata entry through ``gguf.GGUFReader``: one numpy view per
string of the tokenizer's vocabulary and merges, ~4 s for a 49 k vocabulary on an idle core (8 s under load),
~3x that for Qwen's 151 k. And it does so twice per conversion: once for ``AutoConfig``, once more inside
``AutoTokenizer`` (which wants the config's model type), while the tokenizer itself comes from a fast reader.

The config needs none of those arrays, so :func:`config_reader_on_copy` writes a copy of the file's metadata
without them -- the records' bytes as the file holds them (types and all), no tensors, and ``vocab_size``
where the file leaves it to the vocabulary's length -- and, while the conversion runs, points transformers'
legacy config reads of the file at that copy. Nothing else changes: the tokenizer is still read from the file,
and the config is the one transformers builds from the same keys (``tests/model/test_gguf_convert.py`` compares
the two on every architecture we load). ``tie_word_embeddings``, which transformers would infer from the
tensors, is decided by the loader from the whole split set anyway.
"""

from __future__ import annotations

import struct
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pagedkv.model.gguf_file import MAGIC, GGUFFile

_LARGE_ARRAY = 1024  # items: a metadata array this long is a vocabulary's, never a config value
_UINT32 = 4  # GGUF's metadata value type id
# Held from the patch of transformers' module global to its restore: two engines loading at once in one process
# (two threads) would each restore what it found, the last leaving the other's reader in place (its copy deleted)
# and the first pulling the copy from under the other. Conversions take turns instead (each holds it through
# its config and tokenizer reads); reentrant, so a conversion inside a conversion on one thread nests as before.
_PATCH_LOCK = threading.RLock()


def _is_large_array(value: Any) -> bool:
    return isinstance(value, list) and len(value) > _LARGE_ARRAY


def _uint32_record(key: str, value: int) -> bytes:
    name = key.encode()
    return struct.pack("<Q", len(name)) + name + struct.pack("<II", _UINT32, value)


def write_metadata_only(gguf: GGUFFile, out: Path) -> None:
    """``out``: a GGUF file (version 3, no tensors) holding ``gguf``'s metadata but its long arrays, plus
    ``<arch>.vocab_size`` (the tokenizer's length) if the file has none: transformers would count the tokens."""
    kept = [key for key, value in gguf.metadata.items() if not _is_large_array(value)]
    records = [gguf.metadata_record(key) for key in kept]
    vocab_key = f"{gguf.architecture}.vocab_size"
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if vocab_key not in gguf.metadata and isinstance(tokens, list):
        records.append(_uint32_record(vocab_key, len(tokens)))
    with open(out, "wb") as f:
        f.write(MAGIC + struct.pack("<IQQ", 3, 0, len(records)))
        for record in records:
            f.write(record)


@contextmanager
def config_reader_on_copy(path: Path) -> Iterator[None]:
    """While inside: transformers' legacy GGUF config reads of ``path`` (``load_gguf_checkpoint`` without
    tensors) read a metadata-only copy of it instead (see the module's docstring). Reads of tensors, and of
    any other file, go to the file as before."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    with tempfile.TemporaryDirectory(prefix="pagedkv-gguf-config-") as tmp:
        copy = Path(tmp) / path.name
        write_metadata_only(GGUFFile(path), copy)
        target = str(path.resolve())

        def load(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
            if not return_tensors and not args and not kwargs and str(Path(gguf_checkpoint_path).resolve()) == target:
                return original(str(copy), return_tensors=False)
            return original(gguf_checkpoint_path, return_tensors, *args, **kwargs)

        with _PATCH_LOCK:
            original = gguf_utils.load_gguf_checkpoint
            gguf_utils.load_gguf_checkpoint = load
            try:
                yield
            finally:
                gguf_utils.load_gguf_checkpoint = original
