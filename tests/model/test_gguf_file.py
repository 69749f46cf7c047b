"""GGUF files that are not what they claim: each refused with an error naming the file and what is wrong (the
tensor, where there is one), before anything large is allocated. And what the reader must accept: split sets,
and tensor types without a kernel, de-quantised once with a warning that says so."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedkv import LLM, SamplingParams
from pagedkv.model import panel
from pagedkv.model.gguf_file import GGUFError, GGUFFile
from pagedkv.model.loader import load_model
from tests.tiny_gguf import save_tiny_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", T.Q8_0)


def _copy(tmp_path: Path, data: bytes) -> Path:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    return bad


def test_a_truncated_file_names_the_tensor_it_ends_inside(good, tmp_path):
    data = good.read_bytes()
    last = max(GGUFFile(good).tensors.values(), key=lambda t: t.data.data_ptr())
    bad = _copy(tmp_path, data[:-100])
    with pytest.raises(GGUFError, match=rf"bad.gguf ends inside tensor '{last.name}': the file is truncated"):
        load_model(str(bad))
    with pytest.raises(GGUFError, match="bad.gguf ends inside its header"):
        load_model(str(_copy(tmp_path, data[:300])))


def test_not_gguf_and_a_wrong_version_are_refused(good, tmp_path):
    with pytest.raises(GGUFError, match="bad.gguf is not a GGUF file"):
        load_model(str(_copy(tmp_path, b"PK\x03\x04" + good.read_bytes()[4:])))
    with pytest.raises(GGUFError, match="GGUF version 7 is not supported"):
        load_model(str(_copy(tmp_path, b"GGUF" + struct.pack("<I", 7) + good.read_bytes()[8:])))


def _patch_tensor_record(good: Path, tmp_path: Path, name: str, ggml_type: int | None = None, dim0: int | None = None):
    """The file with one field of tensor ``name``'s header record replaced (its first dimension, or its type)."""
    data = bytearray(good.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if dim0 is not None:
        struct.pack_into("<Q", data, at + 4, dim0)
    if ggml_type is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    return _copy(tmp_path, bytes(data))


def test_a_byte_count_that_does_not_match_type_and_shape_is_refused(good, tmp_path):
    """A Q8_0 row of 100 weights is not whole 32-weight blocks; an unknown type id has no size at all."""
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.ffn_up.weight' has shape \[100, .*not whole Q8_0 blocks"):
        load_model(str(_patch_tensor_record(good, tmp_path, "blk.0.ffn_up.weight", dim0=100)))
    with pytest.raises(GGUFError, match="tensor 'blk.1.attn_v.weight' has an unknown ggml type id 250"):
        load_model(str(_patch_tensor_record(good, tmp_path, "blk.1.attn_v.weight", ggml_type=250)))
    # Q4_0 blocks are smaller than Q8_0's: the same bytes now end far before the file does -- no error there --
    # but a type with bigger blocks reads past the end, which the truncation check catches, naming the tensor
    with pytest.raises(GGUFError, match="ends inside tensor"):
        load_model(str(_patch_tensor_record(good, tmp_path, "output.weight", ggml_type=int(T.F32))))


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    path = save_tiny_gguf(tmp_path / "m.gguf", T.Q8_0)
    data = path.read_bytes().replace(b"llama", b"mamba")  # the architecture and every key named after it
    with pytest.raises(GGUFError, match=r"architecture 'mamba' is not supported: pagedkv runs GGUF files of"):
        load_model(str(_copy(tmp_path, data)))


def test_a_vocabulary_that_does_not_match_the_embedding_is_refused(tmp_path):
    path = save_tiny_gguf(tmp_path / "m.gguf", T.Q8_0)
    data = bytearray(path.read_bytes())
    key = b"llama.vocab_size"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4  # past the key and its value type
    struct.pack_into("<I", data, at, 500)
    with pytest.raises(GGUFError, match=r"tensor 'token_embd.weight' has 512 rows but the vocabulary has 500 tokens"):
        load_model(str(_copy(tmp_path, bytes(data))))


def test_a_split_set_loads_from_any_of_its_files_and_a_missing_part_is_named(tmp_path):
    first = save_tiny_gguf(tmp_path / "split.gguf", T.Q4_0, split_max_tensors=8)
    files = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert first == files[0] and len(files) == 3
    whole = save_tiny_gguf(tmp_path / "whole.gguf", T.Q4_0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    texts = []
    for path in (whole, files[1]):
        llm = LLM(model=str(path), num_kv_blocks=32, max_model_len=128)
        texts.append(llm.generate(prompt_token_ids=[[1, 30, 31, 32]], sampling_params=params)[0].token_ids)
        llm.engine.close()
    assert texts[0] == texts[1]
    files[2].unlink()
    with pytest.raises(GGUFError, match=r"part 00001 of 3, but \['split-00003-of-00003.gguf'\] are missing"):
        GGUFFile(first)


def test_a_type_without_a_kernel_is_dequantised_once_with_a_warning(tmp_path, caplog):
    """A layer whose type has no panel format (IQ4_NL: an fp16 scale and 4-bit indices into a fixed table, blocks
    the size of Q4_0's, so a Q4_0 tensor's bytes relabelled are valid IQ4_NL) computes in fp32 on the weights gguf
    de-quantises, with a warning naming the tensor, its type and the memory it costs."""
    from transformers import AutoModelForCausalLM

    good = save_tiny_gguf(tmp_path / "q4_0.gguf", T.Q4_0)
    relabelled = _patch_tensor_record(good, tmp_path, "blk.0.ffn_gate.weight", ggml_type=int(T.IQ4_NL))
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.gguf_weights"):
        loaded = load_model(str(relabelled), kernels=True)
    assert "tensor 'blk.0.ffn_gate.weight' is IQ4_NL, which pagedkv has no kernel for" in caplog.text
    gate = loaded.model.layers[0].mlp.gate_up_proj
    assert [p.format for p in gate.panels] == ["fp32", "q4"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=relabelled.name, dtype=torch.float32)
    expected = hf.model.layers[0].mlp.gate_proj.weight
    assert torch.equal(panel.rows(gate.panels[0], torch.arange(expected.shape[0])), expected)
