"""Checkpoint: the safetensors reader the loader uses, against the safetensors library's own reader."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pagedkv.model.checkpoint import Checkpoint


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(7, 5, generator=g),
        "f16": torch.randn(3, 4, 2, generator=g).half(),
        "bf16": torch.randn(9, generator=g).bfloat16(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "i32": torch.randint(-1000, 1000, (2, 3), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),
        "i8": torch.randint(-128, 128, (4, 1), generator=g, dtype=torch.int8),
        "bool": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    return out


def test_reads_every_tensor_as_the_safetensors_library_does(tmp_path):
    save_file(_tensors(), tmp_path / "a.safetensors", metadata={"format": "pt"})
    save_file({"other": torch.arange(10.0)}, tmp_path / "b.safetensors")
    expected = load_file(tmp_path / "a.safetensors") | load_file(tmp_path / "b.safetensors")
    checkpoint = Checkpoint([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert sorted(checkpoint) == sorted(expected) and len(checkpoint) == len(expected)
    for name, reference in expected.items():
        got = checkpoint[name]
        assert got.dtype == reference.dtype and got.shape == reference.shape, name
        assert torch.equal(got, reference), name


def test_a_truncated_file_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"first": torch.zeros(4), "last": torch.ones(1000)}, path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])
    with pytest.raises(ValueError, match="'last': the file is truncated"):
        Checkpoint([path])  # refused from the header, before anything is read or allocated
    path.write_bytes(whole)
    checkpoint = Checkpoint([path])
    path.write_bytes(whole[:-100])  # cut after the header was read
    with pytest.raises(ValueError, match="'last': the file is truncated"):
        checkpoint["last"]


def _with_header(path, header: dict, data: bytes = bytes(64)) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "bad shape"),
        ({"t": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}, "bad shape"),
        ({"t": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}}, "truncated"),
        ({"t": {"dtype": "F32", "shape": [2]}}, "lacks a dtype"),
        ({"t": "F32"}, "lacks a dtype"),
        ({"t": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, "bad shape"),
        (["F32"], "not a JSON object"),
    ],
)
def test_a_hostile_header_is_refused_naming_the_file(tmp_path, header, message):
    path = tmp_path / "h.safetensors"
    _with_header(path, header)
    with pytest.raises(ValueError, match=f"h.safetensors.*{message}"):
        Checkpoint([path])


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    for content in (b"\xff" * 64, b"\x04", b"\x04" + bytes(7) + b"\xff\xfe{}", b"\x02" + bytes(7) + b"{"):
        path.write_bytes(content)
        with pytest.raises(ValueError, match="not a safetensors file"):
            Checkpoint([path])


def _rss_file_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    pytest.skip("/proc/self/status has no RssFile here")


def test_reading_a_tensor_leaves_no_file_pages_in_the_process(tmp_path):
    """The reason the reader exists: safe_open's mapped pages stay resident; these reads leave none behind.

    The control is safe_open on the same file, which must grow the file-backed RSS by about the data read, so
    the assertion on the reader cannot pass merely because the measure moves too little.
    """
    path = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.randn(1024, 1024) for i in range(16)}, path)  # 64 MiB
    handle = safe_open(str(path), framework="pt")
    start = _rss_file_mb()
    kept = [handle.get_tensor(f"w{i}").sum() for i in range(16)]
    mapped_growth = _rss_file_mb() - start
    del handle, kept
    assert mapped_growth > 48, f"control: safe_open grew file RSS by only {mapped_growth:.1f} MiB"
    checkpoint = Checkpoint([path])
    start = _rss_file_mb()
    sums = [checkpoint[f"w{i}"].sum() for i in range(16)]
    assert _rss_file_mb() - start < 8
    assert len(sums) == 16
