"""``csrc/simd.h``'s fp16 load and store, both ways they compile: with F16C (``-march=native`` here) and the
portable fallback (``-march=x86-64``: no AVX, so no F16C), which no build on these machines otherwise runs.

A small program compiled from the header widens every one of the 65,536 fp16 bit patterns and rounds floats
across fp16's whole range and its edges; numpy's fp16 widening and torch's ``Tensor.half()`` are the
references, bit for bit. The kernels' fp16 pools (``kv_cache_dtype="float16"``) stand on these two functions.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

CSRC = Path(__file__).resolve().parents[2] / "pagedkv" / "csrc"
CXX = shutil.which(os.environ.get("CXX", "c++"))
PROGRAM = r"""
#include <cstdio>
#include "simd.h"
using namespace pagedkv::simd;
// stdin: n, n fp16 bit patterns, n floats (hex); stdout: the patterns widened (hex), the floats' fp16 bits.
int main() {
  long n;
  if (std::scanf("%ld", &n) != 1 || n % kLanes) return 2;
  for (long i = 0; i < n; i += kLanes) {
    uint16_t bits[kLanes];
    for (auto& b : bits) { unsigned u; if (std::scanf("%u", &u) != 1) return 3; b = static_cast<uint16_t>(u); }
    _Float16 h[kLanes];
    std::memcpy(h, bits, sizeof(h));
    const Vec v = load(h);
    for (int j = 0; j < kLanes; ++j) std::printf("%a\n", static_cast<double>(v[j]));
  }
  for (long i = 0; i < n; i += kLanes) {
    float f[kLanes];
    for (auto& x : f) if (std::scanf("%a", &x) != 1) return 4;
    _Float16 h[kLanes];
    store(h, load(f));
    uint16_t bits[kLanes];
    std::memcpy(bits, h, sizeof(bits));
    for (auto b : bits) std::printf("%u\n", static_cast<unsigned>(b));
  }
}
"""


def _floats(n: int) -> np.ndarray:
    """Normal values from 1e-9 to 1e5 in magnitude, and the edges: fp16's top, the overflow threshold and
    past it, the subnormals and the ties below them, zeros and infinities; zero-padded to n."""
    rng = np.random.default_rng(0)
    wide = rng.standard_normal(40_000) * 10.0 ** rng.integers(-9, 6, 40_000)
    edges = [65504, 65519.99, 65520, 7e4, -1e5, 2**-24, 2**-25, 3 * 2**-26, 2**-14, 0.0, -0.0, np.inf, -np.inf]
    values = np.concatenate([wide, edges]).astype(np.float32)
    return np.concatenate([values, np.zeros(n - len(values), np.float32)])


@pytest.mark.skipif(CXX is None, reason="no C++ compiler here")
@pytest.mark.parametrize("march", ["native", "x86-64"], ids=["f16c", "portable"])
def test_fp16_widening_and_rounding_match_numpy_and_torch(tmp_path, march):
    if march == "x86-64" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-march=x86-64 picks the fallback on x86 only")
    (tmp_path / "t.cpp").write_text(PROGRAM)
    exe = tmp_path / f"t_{march}"
    flags = ["-O2", f"-march={march}", "-std=c++17", "-Wno-psabi", f"-I{CSRC}"]
    subprocess.run([CXX, *flags, "-o", str(exe), str(tmp_path / "t.cpp")], check=True)
    patterns = np.arange(65_536, dtype=np.uint16)
    floats = _floats(len(patterns))
    stdin = "\n".join([str(len(patterns)), *map(str, patterns), *(float(x).hex() for x in floats)]) + "\n"
    result = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True)
    out = result.stdout.split()
    widened = np.array([float.fromhex(x) for x in out[: len(patterns)]], np.float32)
    expected = patterns.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(widened[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    assert np.isnan(widened[nan]).all()
    rounded = np.array(out[len(patterns) :], dtype=np.int64).astype(np.uint16)
    assert np.array_equal(rounded, torch.from_numpy(floats).half().numpy().view(np.uint16))
