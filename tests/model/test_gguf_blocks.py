"""Every supported ggml type is read bit for bit as gguf's numpy ``dequantize`` reads it (what HF transformers
loads): row by row from the file's blocks, and through the panels ``gguf_pack`` lays out.

The blocks are random bytes, so every code, scale and bit pattern turns up, with the fp16 scale fields made
finite (extremes included). The packed panels are read back by a torch reader of the panel layouts (the
header of csrc/panel_linear.cpp) written here, independent of the C++.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as numpy_dequantize

from pagedkv import kernels
from pagedkv.model import gguf_blocks
from pagedkv.model.panel import PanelWeight

pytestmark = pytest.mark.skipif(not kernels.portable.available(), reason="the compiled ops cannot be built here")

T = GGMLQuantizationType
SUPPORTED = list(gguf_blocks.TYPES)
# (type, panel format): every format each type packs into
PACKINGS = [(ggml_type, fmt) for ggml_type, t in gguf_blocks.TYPES.items() for fmt in t.formats]
# (n, blocks per row): n never a whole number of panels but once, k from one block to several
SHAPES = [(5, 1), (37, 3), (32, 2)]
# Byte offsets of each block's fp16 scale fields (d, and m or dmin), from gguf/quants.py's dequantize_blocks
FP16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
EXTREME_SCALES = [65504.0, -65504.0, 2.0**-24, 0.0, -0.0]  # fp16's largest, its smallest subnormal, zeros
# Float types: (integer view, exponent mask); an inf or NaN pattern gets its exponent's top bit cleared
FLOAT_BITS = {T.F32: (torch.int32, 0x7F800000), T.F16: (torch.int16, 0x7C00), T.BF16: (torch.int16, 0x7F80)}


def random_blocks(ggml_type: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 ``[n, row_bytes]``: random blocks whose fp16 scales (or float elements) are finite."""
    g = torch.Generator().manual_seed(seed)
    block_size, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    blocks = torch.randint(0, 256, (n * (k // block_size), type_size), dtype=torch.uint8, generator=g)
    if ggml_type in FLOAT_BITS:
        int_dtype, exponent = FLOAT_BITS[T(ggml_type)]
        bits = blocks.view(int_dtype)
        special = (bits & exponent) == exponent
        bits[special] &= ~(1 << (bits.element_size() * 8 - 2))
        return blocks.view(n, -1)
    for i, offset in enumerate(FP16_FIELDS[T(ggml_type)]):
        scales = torch.randn(len(blocks), generator=g) * 0.05
        extremes = torch.tensor(EXTREME_SCALES).roll(i)[: len(blocks)]
        scales[: len(extremes)] = extremes
        blocks[:, offset : offset + 2] = scales.half().view(torch.uint8).view(-1, 2)
    return blocks.view(n, -1)


def reference(raw: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.array(numpy_dequantize(raw.numpy(), T(ggml_type)), dtype=np.float32)).view(n, k)


# Bytes a weight takes in each panel format: a record's bytes over the 16 outputs x G k it holds.
PANEL_BYTES_PER_WEIGHT = {
    "fp32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q4": 384 / (16 * 32),
    "q8": 576 / (16 * 32),
    "q8m": 640 / (16 * 32),
    "q4g16": 256 / (16 * 16),
    "q8g16": 320 / (16 * 16),
    "q4k": 2432 / (16 * 256),
    "q6k": 3392 / (16 * 256),
    "q5": 384 / (16 * 32),
    "q5k": 2944 / (16 * 256),
    "q2k": 2688 / (16 * 256),
    "q3k": 2368 / (16 * 256),
}
# Quantised panel formats: (group G, code bits, has a min), and the float ones' element dtypes
RECORDS = {
    "q4": (32, 4, True),
    "q8": (32, 8, False),
    "q8m": (32, 8, True),
    "q4g16": (16, 4, True),
    "q8g16": (16, 8, False),
}
FLOAT_FORMATS = {
    "fp32": (torch.float32, torch.int32),
    "f16": (torch.float16, torch.int16),
    "bf16": (torch.bfloat16, torch.int16),
}
# Compact formats: (unit: k per record, sub: k per sub-block (= unit: no sub-block scales), high: code bits past
# the low nibble, has a min, offset subtracted from a code without a min)
COMPACT = {
    "q4k": (256, 32, 0, True, 0),
    "q6k": (256, 16, 2, False, 32),
    "q5": (32, 32, 1, False, 16),
    "q5k": (256, 32, 1, True, 0),
    "q2k": (256, 16, 0, True, 0),
    "q3k": (256, 16, 0, False, 4),
}


def read_compact(weight: PanelWeight) -> torch.Tensor:
    """A compact packed weight as fp32 ``[n, k]``: ``(d sc) u - dmin mn`` or ``(d sc) (u - offset)`` per
    sub-block, from the parts of each record in order (d, dmin, then per sub-block: scales, mins, high-bit words,
    low nibbles); asserts that the padding lanes past ``n`` hold zero bytes only."""
    n, k = weight.n, weight.k
    panels = -(-n // 16)
    unit, sub, high, has_min, offset = COMPACT[weight.format]
    records = weight.packed.view(panels, k // unit, -1)
    parts = []  # each [panels, records, ..., 16]
    start = 0

    def take(nbytes: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:  # the next part of every record
        nonlocal start
        part = records[..., start : start + nbytes].contiguous().view(dtype).view(panels, k // unit, *shape, 16)
        start += nbytes
        parts.append(part)
        return part

    d = take(64, torch.float32, 1)
    dmin = take(64, torch.float32, 1) if has_min else None
    codes, scales, mins = [], [], []
    for _ in range(unit // sub):
        if sub < unit:
            scales.append(take(16, torch.int8 if weight.format in ("q6k", "q3k") else torch.uint8, 1).float())
            if has_min:
                mins.append(take(16, torch.uint8, 1).float())
        words = take(64, torch.int32, 1) if high else None
        low = take(sub * 8, torch.uint8, sub // 2)  # k-pair p: k = 2p in the low nibble, 2p + 1 in the high one
        u = torch.stack([low & 15, low >> 4], dim=3).reshape(panels, k // unit, sub, 16).int()
        if high:  # bits high * j of the word: k = j of the sub-block
            u |= ((words >> (torch.arange(sub) * high).view(-1, 1)) & ((1 << high) - 1)) << 4
        codes.append(u)
    assert start == records.shape[-1]
    u = torch.stack(codes, dim=2)  # [panels, records, sub-blocks, sub, 16]
    scale = (d * torch.cat(scales, dim=2) if scales else d).unsqueeze(3)
    # numpy's (d sc) u - dmin mn, or (d sc) (u - offset)
    w = scale * u.float() - (dmin * torch.cat(mins, dim=2)).unsqueeze(3) if has_min else scale * (u - offset).float()

    def by_lane(t: torch.Tensor) -> torch.Tensor:  # [panels, records, ..., 16] -> [panels * 16, ...]
        return t.movedim(-1, 1).reshape(panels * 16, -1)

    assert not any(
        by_lane(p.view(torch.uint8) if p.element_size() == 1 else p.view(torch.int32))[n:].any() for p in parts
    )
    return by_lane(w)[:n]


def read_panels(weight: PanelWeight) -> torch.Tensor:
    """The packed weight as fp32 ``[n, k]``, read as the panel layouts say (``d * q + m`` per record, fp32
    ops); asserts that the padding lanes past ``n`` hold zero bytes only."""
    n, k = weight.n, weight.k
    panels = -(-n // 16)

    def by_lane(t: torch.Tensor) -> torch.Tensor:  # [panels, a, b, 16] -> [panels * 16, a * b]
        return t.permute(0, 3, 1, 2).reshape(panels * 16, -1)

    if weight.format in COMPACT:
        return read_compact(weight)
    if weight.format in FLOAT_FORMATS:
        dtype, int_dtype = FLOAT_FORMATS[weight.format]
        values = weight.packed.view(dtype).view(panels, 1, k, 16)
        assert not by_lane(values.view(int_dtype))[n:].any()
        return by_lane(values)[:n].float()
    group, bits, has_min = RECORDS[weight.format]
    code_bytes = group * 16 * bits // 8
    records = weight.packed.view(panels, k // group, -1)
    assert records.shape[-1] == code_bytes + 64 * (1 + has_min)
    codes = records[..., :code_bytes].reshape(panels, k // group, -1, 16)  # [panels, groups, bytes / 16, 16]
    if bits == 4:  # byte p of an output: k = 2p in the low nibble, 2p + 1 in the high one
        q = torch.stack([codes & 15, codes >> 4], dim=3).reshape(panels, k // group, group, 16).float()
    else:
        q = codes.view(torch.int8).float()
    scales = records[..., code_bytes:].contiguous().view(torch.float32).view(panels, k // group, -1, 16)
    w = q * scales[:, :, :1]
    if has_min:
        w = w + scales[:, :, 1:]
    assert not by_lane(codes)[n:].any() and not by_lane(scales.view(torch.int32))[n:].any()
    return by_lane(w)[:n]


@pytest.mark.parametrize(
    ("ggml_type", "fmt"), PACKINGS, ids=[f"{gguf_blocks.TYPES[t].name}-{fmt}" for t, fmt in PACKINGS]
)
@pytest.mark.parametrize(("n", "blocks"), SHAPES)
def test_rows_and_panels_match_numpy_bit_for_bit(ggml_type: int, fmt: str, n: int, blocks: int) -> None:
    k = blocks * gguf_blocks.TYPES[ggml_type].block_size
    raw = random_blocks(ggml_type, n, k, seed=n + blocks)
    want = reference(raw, ggml_type, n, k)
    assert not want.isnan().any()

    everything = gguf_blocks.dequantize(raw, ggml_type, n, k)
    assert everything.dtype == torch.float32 and torch.equal(everything, want)
    ids = torch.tensor([n - 1, 0, n // 2, 0])
    assert torch.equal(gguf_blocks.rows(raw, ggml_type, ids, k), want[ids])
    assert gguf_blocks.rows(raw, ggml_type, [], k).shape == (0, k)

    weight = gguf_blocks.pack(raw, ggml_type, n, k, fmt)
    assert weight.format == fmt and (weight.n, weight.k) == (n, k)
    assert weight.nbytes == -(-n // 16) * 16 * k * PANEL_BYTES_PER_WEIGHT[fmt]
    got = read_panels(weight)
    assert torch.equal(got, want)
    if ggml_type != T.Q4_0:  # signs of zero too; Q4_0's d q - 8 d is numpy's d (q - 8) up to the sign of a 0
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_a_read_only_memory_map_is_only_read(tmp_path) -> None:
    n, k, ggml_type = 21, 512, int(T.Q4_K)
    raw = random_blocks(ggml_type, n, k)
    path = tmp_path / "blocks.bin"
    path.write_bytes(raw.numpy().tobytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=tuple(raw.shape)))
    # a write into the read-only mapping would crash the process
    assert torch.equal(gguf_blocks.pack(mapped, ggml_type, n, k).packed, gguf_blocks.pack(raw, ggml_type, n, k).packed)
    assert torch.equal(gguf_blocks.rows(mapped, ggml_type, [3, 20], k), reference(raw, ggml_type, n, k)[[3, 20]])


def test_bad_inputs_are_value_errors_that_say_what_is_wrong() -> None:
    raw = random_blocks(int(T.Q4_K), 3, 512)
    with pytest.raises(ValueError, match="bytes"):
        gguf_blocks.pack(raw.view(-1)[:-1], int(T.Q4_K), 3, 512)
    with pytest.raises(ValueError, match="bytes"):
        gguf_blocks.dequantize(raw, int(T.Q4_K), 4, 512)
    with pytest.raises(ValueError, match="whole number of rows"):
        gguf_blocks.rows(raw.view(-1)[:-1], int(T.Q4_K), [0], 512)
    with pytest.raises(ValueError, match="block size 256"):
        gguf_blocks.pack(raw, int(T.Q4_K), 12, 128)
    with pytest.raises(ValueError, match=r"ids\[1\] = 3 is outside \[0, 3\)"):
        gguf_blocks.rows(raw, int(T.Q4_K), [0, 3], 512)
    with pytest.raises(ValueError, match="Q4_K packs into q4k or q4, not 'q6k'"):
        gguf_blocks.pack(raw, int(T.Q4_K), 3, 512, "q6k")
    with pytest.raises(ValueError, match="packs into panel format 1 or 8, not 9"):
        torch.ops.pagedkv.gguf_pack(raw, int(T.Q4_K), 3, 512, 9)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        gguf_blocks.pack(raw, int(T.IQ2_XXS), 3, 512)
    with pytest.raises(ValueError, match="unknown ggml type id 99"):
        gguf_blocks.block_type(99)
    for op in (
        lambda: torch.ops.pagedkv.gguf_pack(raw, 99, 3, 512, 1),
        lambda: torch.ops.pagedkv.gguf_rows(raw, 16, torch.tensor([0]), 512),
    ):
        with pytest.raises(ValueError, match="unknown or has no panel format"):
            op()
    with pytest.raises(ValueError, match="uint8"):
        torch.ops.pagedkv.gguf_pack(raw.float(), int(T.Q4_K), 3, 512, 1)
