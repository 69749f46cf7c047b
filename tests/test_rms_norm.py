"""The compiled RMSNorm (with and without the fused residual add) against torch's ``F.rms_norm``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.model import kernels
from pagedkv.model.layers import RMSNorm

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the model kernels could not be built here")


@pytest.mark.parametrize(("rows", "size"), [(1, 576), (9, 576), (100, 576), (3, 37), (0, 64)])
def test_matches_torch(rows: int, size: int) -> None:
    x, delta, weight = torch.randn(rows, size) * 3, torch.randn(rows, size), torch.rand(size) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (size,), weight, 1e-5))
    residual = x.clone()
    out = kernels.rms_norm(delta, weight, 1e-5, residual)
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
        kernels.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        kernels.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(3, 8))
