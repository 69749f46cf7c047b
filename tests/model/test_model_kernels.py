"""The compiled element-wise ops against torch: RMSNorm (with and without the fused residual add), SiLU-and-
multiply, RoPE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv import kernel_ops, kernels
from pagedkv.model.layers import RMSNorm
from pagedkv.model.rope import apply_rope

pytestmark = pytest.mark.skipif(not kernels.portable.available(), reason="the compiled ops could not be built here")


@pytest.mark.parametrize(("rows", "size"), [(1, 576), (9, 576), (100, 576), (3, 37), (0, 64)])
def test_matches_torch(rows: int, size: int) -> None:
    x, delta, weight = torch.randn(rows, size) * 3, torch.randn(rows, size), torch.rand(size) + 0.5
    torch.testing.assert_close(kernel_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (size,), weight, 1e-5))
    residual = x.clone()
    out = kernel_ops.rms_norm(delta, weight, 1e-5, residual)
    torch.testing.assert_close(residual, x + delta, rtol=0, atol=0)  # the sum lands in the residual exactly
    torch.testing.assert_close(out, F.rms_norm(x + delta, (size,), weight, 1e-5))


def test_module_fused_and_fallback_paths_agree() -> None:
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    h, delta = torch.randn(5, 64), torch.randn(5, 64)
    expected_h, expected = h + delta, F.rms_norm(h + delta, (64,), norm.weight, 1e-6)
    for compiled in (False, True):
        norm.compiled = compiled
        residual = h.clone()
        torch.testing.assert_close(norm(delta.t().contiguous().t(), residual=residual), expected)  # strided x
        torch.testing.assert_close(residual, expected_h, rtol=0, atol=0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RuntimeError, match="weight"):
        kernel_ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        kernel_ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(3, 8))


@pytest.mark.parametrize("rows", [1, 9, 300, 0])
def test_silu_mul_matches_torch(rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 1536) * 4
    if rows:  # the exp clamp: far outside it silu is x or 0, and must stay finite
        gate_up[0, :6] = torch.tensor([-1e4, 1e4, 0.0, -88.5, 88.5, -20.0])
    expected = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    got = kernel_ops.silu_mul(gate_up)
    assert got.shape == (rows, 1536) and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    with pytest.raises(RuntimeError, match="gate_up"):
        kernel_ops.silu_mul(torch.randn(3, 5))


@pytest.mark.parametrize(("tokens", "dim"), [(1, 64), (7, 64), (40, 128), (3, 6)])
def test_rope_in_place_on_a_strided_view(tokens: int, dim: int) -> None:
    qkv = torch.randn(tokens, 15, dim)
    cos, sin = torch.randn(tokens, 1, dim), torch.randn(tokens, 1, dim)
    expected = apply_rope(qkv[:, :12], cos, sin)
    work = qkv.clone()
    out = kernel_ops.rope_(work[:, :12], cos, sin)  # q|k heads of a fused qkv row: not contiguous
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(work[:, :12], expected, rtol=1e-6, atol=1e-6)  # in place
    assert torch.equal(work[:, 12:], qkv[:, 12:])  # v heads untouched
    with pytest.raises(RuntimeError, match="cos"):
        kernel_ops.rope_(work[:, :12], torch.randn(tokens + 1, 1, dim), sin)
