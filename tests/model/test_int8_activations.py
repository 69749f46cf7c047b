"""The int8-activation GEMM (``csrc/int8_linear.cpp``, ``weight_format="gguf-int8"``) against an independent numpy
reference of llama.cpp's arithmetic: x quantised as ggml's reference quantisers do, integer dot products with the
weights' codes, the block scales applied in fp32 -- per type, on random blocks with extreme scales, on every
instruction-set path; the quantisation itself against the ``gguf`` package's; batch invariance bit for bit.
Every type is repacked in groups of 16 outputs (``csrc/int8_repack.h``, what "gguf-int8" loads it as) and runs
the tiled kernel (``csrc/int8_tiled.h``), whose float steps are canonical: the numpy reference replays them bit
for bit (:func:`canonical`), and that replay is held to fp32 rounding of the exact sums.
The end-to-end check (a tiny GGUF model, exact vs int8 logits) is in tests/model/test_int8_model.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pagedkv import kernels
from pagedkv.model import int8_linear, panel
from pagedkv.model.panel import INT8_REPACKED_BASE

pytestmark = pytest.mark.skipif(not kernels.gemm.available(), reason="the GEMM library does not build here")

AUTO, AVX2, VNNI = 0, 1, 2
PATHS = [AVX2] + ([VNNI] if "avx512_vnni" in Path("/proc/cpuinfo").read_text().split() else [])
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]  # what "gguf-int8" repacks for the tiled kernel
BLOCK = {T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q5_0: (32, 22), T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q6_K: (256, 210)}
HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}
# fp16 scales the random blocks draw from: ordinary ones and the extremes (largest, smallest normal, subnormal, 0)
EXTREME_HALVES = np.array([65504.0, -65504.0, 6.1035e-05, 6e-08, -6e-08, 0.0, 1.0, -0.5], dtype=np.float16)


def random_blocks(ggml_type: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, row bytes]`` random blocks whose fp16 scales are finite: small ones mostly, extremes sometimes."""
    block, size = BLOCK[ggml_type]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in HALF_FIELDS[ggml_type]:
        halves = rng.normal(0, 1e-2, size=(n, k // block)).astype(np.float16)
        extreme = rng.random((n, k // block)) < 0.1
        halves[extreme] = rng.choice(EXTREME_HALVES, size=int(extreme.sum()))
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


# ---- The reference: llama.cpp's arithmetic, in numpy ------------------------------------------------------------


def roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: half away from zero (not floor(|v| + 0.5), which rounds 0.49999997 up in fp32)."""
    magnitude = np.abs(v)
    floored = np.floor(magnitude)
    return np.sign(v) * (floored + np.floor(2 * (magnitude - floored)))


def quantise_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_0_ref / _q8_1_ref: codes [M, K], fp16-rounded d [M, K/32], Q8_1's sa [M, K/32]."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d)).astype(np.float32)
    q = roundf(blocks * inverse[..., None]).astype(np.int32)
    sa = (q.sum(axis=-1).astype(np.float32) * d).astype(np.float16).astype(np.float32)
    return q.reshape(x.shape), d.astype(np.float16).astype(np.float32), sa


def quantise_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_K_ref: codes [M, K], fp32 d [M, K/256], bsums [M, K/16]."""
    blocks = x.reshape(x.shape[0], -1, 256)
    first_max = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    zero = first_max == 0
    iscale = np.where(zero, np.float32(0), np.float32(-127) / np.where(zero, np.float32(1), first_max))
    q = np.minimum(np.rint((iscale[..., None] * blocks).astype(np.float32)), 127).astype(np.int32)
    d = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, np.float32(1), iscale)).astype(np.float32)
    return q.reshape(x.shape), d, q.reshape(x.shape[0], -1, 16).sum(axis=-1)


def half(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy blocks' 16 bytes -> 32 codes: low nibbles first."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)


def legacy_codes(ggml_type: T, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks [..., bytes] -> (codes [..., 32] with the offset taken off, d, m or None): w = d q (+ m)."""
    if ggml_type == T.Q4_0:
        return nibbles(b[..., 2:18]) - 8, half(b, 0), None
    if ggml_type == T.Q4_1:
        return nibbles(b[..., 4:20]), half(b, 0), half(b, 2)
    if ggml_type == T.Q5_0:
        qh = b[..., 2:6].copy().view(np.uint32)
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1
        return nibbles(b[..., 6:22]) + 16 * high.astype(np.int32) - 16, half(b, 0), None
    return b[..., 2:34].view(np.int8).astype(np.int32), half(b, 0), None  # Q8_0


def q4_k_codes(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks -> (codes [..., 256], scales [..., 8], mins [..., 8], d, dmin): w = d sc u - dmin mn."""
    s = b[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], axis=-1)
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*b.shape[:-1], 256).astype(np.int32)
    return codes, sc, mn, half(b, 0), half(b, 2)


def q6_k_codes(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K blocks -> (codes - 32 [..., 256], int8 scales [..., 16], d): w = d sc[c // 16] code."""
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32).astype(np.int32)  # [half, which 32 bytes, l]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32).astype(np.int32)
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # groups g = 0..3 of a half: ql0 low, ql1 low, ql0 hi, ql1 hi
    high = (qh >> (2 * np.arange(4)[:, None])) & 3
    codes = (low | high << 4).reshape(*b.shape[:-1], 256) - 32
    return codes, b[..., 192:208].view(np.int8).astype(np.int32), half(b, 208)


def reference(x: np.ndarray, raw: np.ndarray, ggml_type: T, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(y [M, N], its condition [M, N]) in float64: y from exact integer block sums times ggml's fp32 scales; the
    condition is the same sum over |every product| (weight code times activation code, times their scales),
    what the rounding error of an fp32 evaluation of the sum is relative to."""
    block, size = BLOCK[ggml_type]
    m, w = len(x), raw.reshape(len(raw), k // block, size)
    terms = []  # (fp32 scale [M, N, blocks], exact integer sum, the same over |products|)
    if block == 32:
        q, d, sa = quantise_q8_0(x)
        codes, wd, wm = legacy_codes(ggml_type, w)
        sums = _block_sums(q.reshape(m, -1, 1, 32), codes[:, :, None], np.ones((*w.shape[:2], 1), np.int64))
        terms.append(((wd[None] * d[:, None]).astype(np.float32), *sums))
        if wm is not None:  # Q4_1's min: m times the activations' sa
            terms.append(((wm[None] * sa[:, None]).astype(np.float32), 1, 1))
    else:
        q, d, bsum = quantise_q8_k(x)
        if ggml_type == T.Q4_K:
            codes, sc, mn, wd, wmin = q4_k_codes(w)
            sums = _block_sums(q.reshape(m, -1, 8, 32), codes.reshape(*w.shape[:2], 8, 32), sc)
            by_sub = bsum.reshape(m, -1, 8, 2).sum(-1)[:, None], np.abs(q).reshape(m, -1, 8, 32).sum(-1)[:, None]
            mins = [(b * mn[None]).sum(-1) for b in by_sub]
            terms.append((-(d[:, None] * wmin[None]).astype(np.float32), *mins))
        else:
            codes, sc, wd = q6_k_codes(w)
            sums = _block_sums(q.reshape(m, -1, 16, 16), codes.reshape(*w.shape[:2], 16, 16), sc)
        terms.append(((d[:, None] * wd[None]).astype(np.float32), *sums))
    y = sum((scale.astype(np.float64) * exact).sum(-1) for scale, exact, _ in terms)
    condition = sum((np.abs(scale.astype(np.float64)) * absolute).sum(-1) for scale, _, absolute in terms)
    return y, condition


def _block_sums(q: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activation codes [M, B, S, G] and weight codes [N, B, S, G], sub-block scales [N, B, S] -> per block
    [M, N, B]: the exact sum of sc_s * sum_g q * code, and the same over absolute values."""
    q, codes = q.astype(np.int64), codes.astype(np.int64)
    exact = (np.einsum("mbsg,nbsg->mnbs", q, codes) * scales[None]).sum(-1)
    absolute = (np.einsum("mbsg,nbsg->mnbs", np.abs(q), np.abs(codes)) * np.abs(scales[None])).sum(-1)
    return exact, absolute


def fmaf(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """C's fmaf on float32 arrays: a b + c rounded once. In float64 the product is exact (24 + 24 bits); the sum
    is rounded to odd (TwoSum's error picks the last bit), which the rounding to float32 then leaves correct."""
    p, c = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    s = np.ascontiguousarray(p + c)
    behind = s - c
    error = (p - behind) + (c - (s - behind))
    even = (s.view(np.int64) & 1) == 0
    s = np.where((error != 0) & even, np.nextafter(s, np.where(error > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def canonical(x: np.ndarray, raw: np.ndarray, ggml_type: T, k: int) -> np.ndarray:
    """Every repacked type as the tiled kernel computes it, bit for bit (the order in csrc/int8_tiled.h): per block
    the exact integer sums, then acc = fmaf(isum, da d, acc) and (Q4_K) accm = fmaf(imin, -(da dmin), accm) or
    (Q4_1) accm = fmaf(m, sa, accm), blocks in file order; y = acc + accm, all fp32."""
    m, n = len(x), len(raw)
    if BLOCK[ggml_type][0] == 32:
        q, d, sa = quantise_q8_0(x)
        codes, wd, wm = legacy_codes(ggml_type, raw.reshape(n, k // 32, -1))
        isum = np.einsum("mbg,nbg->mnb", q.reshape(m, -1, 32).astype(np.int64), codes.astype(np.int64))
        if wm is None:
            return _fused(isum, d[:, None] * wd[None], np.zeros_like(isum), np.zeros((m, n, k // 32), np.float32))
        # Q4_1: codes unsigned, accm = fmaf(m, sa, accm)
        return _fused(isum, d[:, None] * wd[None], np.broadcast_to(wm[None], isum.shape), sa[:, None])
    w = raw.reshape(n, k // 256, -1)
    q, d, bsum = quantise_q8_k(x)
    q = q.astype(np.int64)
    if ggml_type == T.Q4_K:
        codes, sc, mn, wd, wmin = q4_k_codes(w)
        dots = np.einsum("mbsg,nbsg->mnbs", q.reshape(m, -1, 8, 32), codes.reshape(n, -1, 8, 32).astype(np.int64))
        imin = (bsum.reshape(m, 1, -1, 8, 2).sum(-1) * mn[None]).sum(-1)
        min_scale = -(d[:, None] * wmin[None])
    else:
        codes, sc, wd = q6_k_codes(w)  # the offset of 32 taken off the codes: the same integer as the kernel's
        dots = np.einsum("mbsg,nbsg->mnbs", q.reshape(m, -1, 16, 16), codes.reshape(n, -1, 16, 16).astype(np.int64))
        imin, min_scale = np.zeros((m, n, k // 256)), np.zeros((m, n, k // 256), np.float32)
    return _fused((dots * sc[None]).sum(-1), d[:, None] * wd[None], imin, min_scale)


def _fused(isum: np.ndarray, scale: np.ndarray, imin: np.ndarray, min_scale: np.ndarray) -> np.ndarray:
    """The canonical float steps over blocks [M, N, B] in file order: exact int32 sums, fp32 scales (products
    rounded as the kernel's), acc and accm fused once a block, added at the end. imin: Q4_K's integer min sums,
    or Q4_1's fp32 m."""
    assert np.abs(isum).max(initial=0) < 2**31  # int32 in the kernel
    acc = accm = np.zeros(isum.shape[:2], np.float32)
    for i in range(isum.shape[-1]):
        acc = fmaf(isum[..., i].astype(np.float32), scale[..., i].astype(np.float32), acc)
        accm = fmaf(imin[..., i].astype(np.float32), min_scale[..., i], accm)
    return acc + accm


def repacked(raw: np.ndarray, ggml_type: T, n: int, k: int) -> torch.Tensor:
    return int8_linear.repack(torch.from_numpy(raw), n, k, ggml_type).packed


def _run_tiled(x: torch.Tensor, packed: torch.Tensor, ggml_type: T, n: int, k: int, path: int = AUTO) -> torch.Tensor:
    return torch.ops.pagedkv._int8_linear_path(x, packed, n, k, INT8_REPACKED_BASE + int(ggml_type), path)


# ---- The reference's own anchors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_reference_decoding_matches_gguf_dequantize(ggml_type):
    """The numpy reference reads the codes and scales that make gguf's de-quantised weights (its own check)."""
    raw = random_blocks(ggml_type, 6, 512, np.random.default_rng(1))
    w = raw.reshape(6, 512 // BLOCK[ggml_type][0], -1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = dequantize(raw, ggml_type).reshape(6, -1, BLOCK[ggml_type][0])
        if ggml_type == T.Q4_K:
            codes, sc, mn, d, dmin = q4_k_codes(w)
            got = ((d[..., None] * sc) * 1.0)[..., :, None] * codes.reshape(*w.shape[:2], 8, 32)
            got = (got - (dmin[..., None] * mn)[..., None]).reshape(want.shape)
        elif ggml_type == T.Q6_K:
            codes, sc, d = q6_k_codes(w)
            got = ((d[..., None] * sc)[..., None] * codes.reshape(*w.shape[:2], 16, 16)).reshape(want.shape)
        else:
            codes, d, m = legacy_codes(ggml_type, w)
            got = d[..., None] * codes + (0 if m is None else m[..., None])
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_1], ids=lambda t: t.name)
def test_q8_0_activations_are_what_gguf_quantises(ggml_type):
    """Q8_0 / Q8_1 activation codes and scales are gguf's numpy quantize(x, Q8_0), blocks of zeros and ties
    included; Q8_1's sa is fp16(d * sum of codes)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 256)).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block
    x[2, :32] = np.arange(32, dtype=np.float32) - 16.0 + 0.5  # halves: roundf's ties
    q, d, sums = torch.ops.pagedkv._int8_quantise(torch.from_numpy(x), INT8_REPACKED_BASE + int(ggml_type))
    blocks = quantize(x, T.Q8_0).reshape(5, -1, 34)
    assert np.array_equal(q.numpy().reshape(5, -1, 32), blocks[..., 2:].view(np.int8))
    assert np.array_equal(d.numpy(), half(blocks, 0))
    if ggml_type == T.Q4_1:
        assert np.array_equal(sums.numpy(), quantise_q8_0(x)[2])


def test_q8_k_activations_are_ggmls():
    """Q8_K codes, d and sums as quantize_row_q8_K_ref makes them: the signed value of largest magnitude (the
    first of a tie) maps to -127, half-way values round to even; a zero block is all zeros."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 512)).astype(np.float32)
    x[1, :256] = 0.0
    x[2, 10], x[2, 20] = -3.0, 3.0  # a tie in magnitude: the first one's sign sets the scale's
    x[3, 256] = 127.0  # the scale is then -1: every other value, k + 0.5, is a tie (to even)
    x[3, 257:] = (np.arange(255) % 253 - 126).astype(np.float32) + np.float32(0.5)
    q, d, bsum = torch.ops.pagedkv._int8_quantise(torch.from_numpy(x), INT8_REPACKED_BASE + int(T.Q4_K))
    want_q, want_d, want_bsum = quantise_q8_k(x)
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(d.numpy(), want_d)
    assert np.array_equal(bsum.numpy(), want_bsum.reshape(4, -1, 2).sum(-1))  # the kernel keeps them per 32


def test_fmaf_rounds_once():
    """(1 + 2^-12)^2 - 1 = 2^-11 + 2^-24: fused, exact; rounded after the product, 2^-11."""
    a = np.array([1 + 2**-12], np.float32)
    assert fmaf(a, a, np.array([-1.0], np.float32))[0] == np.float32(2**-11 + 2**-24)
    assert fmaf(a, a, np.array([0.0], np.float32))[0] == (a * a)[0]


# ---- The repacking and the tiled kernel -------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_repacking_keeps_every_byte(ggml_type):
    """The file's blocks of any rows come back from the groups exactly (37 rows: a last group of 5 and 11 zero
    rows), and the embedding lookup's rows from a repacked weight are gguf's de-quantised weights, bit for bit."""
    raw = random_blocks(ggml_type, 37, 512, np.random.default_rng(9))
    packed = repacked(raw, ggml_type, 37, 512)
    ids = torch.tensor([36, 0, 17, 16, 15, 36])
    back = torch.ops.pagedkv.int8_repacked_blocks(packed, ids, 37, 512, INT8_REPACKED_BASE + int(ggml_type))
    assert np.array_equal(back.numpy(), raw[ids.numpy()])
    weight = panel.PanelWeight(packed, 37, 512, int8_linear.REPACKED[int(ggml_type)])
    with np.errstate(over="ignore", invalid="ignore"):  # the extreme scales
        want = dequantize(raw[ids.numpy()], ggml_type).astype(np.float32)
    np.testing.assert_array_equal(panel.rows(weight, ids).numpy(), want)


@pytest.mark.parametrize("path", PATHS, ids=["avx2", "vnni"][: len(PATHS)])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_tiled_kernel_is_the_canonical_order_bit_for_bit(ggml_type, path):
    """Random blocks with extreme scales, 1-19 rows (tiles of 8 or 4 and a rest), N = 37, 16 and 5 (groups of 16,
    padded): the reference's bits, which are themselves within fp32 rounding of llama.cpp's exact sums."""
    rng = np.random.default_rng(10 + int(ggml_type))
    k = 512 if BLOCK[ggml_type][0] == 256 else 480  # 15 blocks of 32
    for n in (37, 16, 5):
        raw = random_blocks(ggml_type, n, k, rng)
        packed = repacked(raw, ggml_type, n, k)
        for rows in (1, 8, 19):
            x = (rng.normal(size=(rows, k)) * rng.choice([1e-3, 1.0, 1e3], size=(rows, 1))).astype(np.float32)
            want = canonical(x, raw, ggml_type, k)
            assert np.array_equal(_run_tiled(torch.from_numpy(x), packed, ggml_type, n, k, path).numpy(), want)
            exact, condition = reference(x, raw, ggml_type, k)
            assert np.all(np.abs(want - exact) <= 1.5e-6 * condition), (n, rows)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_tiled_rows_do_not_depend_on_their_batch(ggml_type):
    """Each of 33 rows alone gives the bits it gets as row r of every batch of 1..33 rows and in the batch reversed,
    on AVX2 and VNNI alike, on one thread or two."""
    raw = random_blocks(ggml_type, 40, 512, np.random.default_rng(11))
    packed = repacked(raw, ggml_type, 40, 512)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(11))
    alone = torch.cat([_run_tiled(x[i : i + 1], packed, ggml_type, 40, 512, AVX2) for i in range(33)])
    for path in PATHS:
        for rows in range(1, 34):
            assert torch.equal(_run_tiled(x[:rows], packed, ggml_type, 40, 512, path), alone[:rows]), (path, rows)
        assert torch.equal(_run_tiled(x.flip(0), packed, ggml_type, 40, 512, path).flip(0), alone), path
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(_run_tiled(x, packed, ggml_type, 40, 512), alone)
    finally:
        torch.set_num_threads(threads)


def test_tiled_into_fills_only_its_columns():
    """N = 20 (a last group of 4 real columns) into columns [17, 37) of a wider y: nothing else is written."""
    raw = random_blocks(T.Q6_K, 20, 256, np.random.default_rng(12))
    packed = repacked(raw, T.Q6_K, 20, 256)
    x = torch.randn(3, 256)
    y = torch.full((3, 50), float("nan"))
    torch.ops.pagedkv.int8_linear_into(x, packed, 20, 256, INT8_REPACKED_BASE + int(T.Q6_K), y, 17)
    assert torch.equal(y[:, 17:37], _run_tiled(x, packed, T.Q6_K, 20, 256))
    assert y[:, :17].isnan().all() and y[:, 37:].isnan().all()


def test_bad_arguments_are_refused_by_name():
    raw = torch.from_numpy(random_blocks(T.Q4_K, 4, 256, np.random.default_rng(13)))
    packed = repacked(raw.numpy(), T.Q4_K, 4, 256)
    code = INT8_REPACKED_BASE + int(T.Q4_K)
    assert packed.numel() == 2368  # one group of 16 columns, one block
    with pytest.raises(ValueError, match="not an int8-activation format"):
        torch.ops.pagedkv.int8_linear(torch.randn(1, 256), packed, 4, 256, INT8_REPACKED_BASE + int(T.Q5_K))
    with pytest.raises(ValueError, match="not an int8-activation format"):  # 64 + type: the file's blocks, no more
        torch.ops.pagedkv.int8_linear(torch.randn(1, 256), raw, 4, 256, 64 + int(T.Q4_K))
    with pytest.raises(ValueError, match="must be 2368 contiguous uint8 bytes"):
        torch.ops.pagedkv.int8_linear(torch.randn(1, 256), raw, 4, 256, code)
    with pytest.raises(ValueError, match="not a multiple of the block"):
        torch.ops.pagedkv.int8_linear(torch.randn(1, 128), packed, 4, 128, code)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32"):
        torch.ops.pagedkv.int8_linear(torch.randn(1, 200), packed, 4, 256, code)
    with pytest.raises(ValueError, match="not an int8-activation format"):
        torch.ops.pagedkv.int8_repack(raw, 4, 256, 64 + int(T.Q4_K))
    with pytest.raises(ValueError, match="must be 576 contiguous uint8 bytes"):
        torch.ops.pagedkv.int8_repack(packed, 4, 256, code)
    with pytest.raises(ValueError, match="outside"):
        torch.ops.pagedkv.int8_repacked_blocks(packed, torch.tensor([4]), 4, 256, code)
