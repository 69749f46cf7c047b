"""Q4 re-encoding is lossless on Q4_1 weights (synthetic and the default model's) and the kernel is a GEMM.

References are independent of the code under test: weights built from known (d, q, m) and plain
``x @ w.T`` in float64.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.model.q4 import GROUP, LEVELS, encode, kernel_available, q4_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 64)]


def q4_1_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, d, q, m)`` with ``w = d * q + m``, fp16-valued d and m, and q spanning 0..15 in every group.

    llama.cpp's Q4_1 quantiser maps a group's min to q = 0 and its max to q = 15, so real groups hold both.
    """
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // GROUP, generator=g) * 0.15).half().float()
    q = torch.randint(0, LEVELS + 1, (n, k // GROUP, GROUP), generator=g).float()
    pos = torch.randperm(GROUP, generator=g)[:2]
    q[..., pos[0]], q[..., pos[1]] = 0, LEVELS
    w = (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(n, k)
    return w, d, q, m


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_encode_recovers_synthetic_q4_1_groups(n: int, k: int) -> None:
    w, d, q, m = q4_1_weight(n, k)
    packed = encode(w)
    assert packed is not None
    assert packed.shape == (n, k)
    assert packed.qweight.dtype == torch.uint8 and packed.qweight.shape == (n, k // 2)
    torch.testing.assert_close(packed.m, m, rtol=0, atol=0)
    torch.testing.assert_close(packed.d, d, rtol=1e-6, atol=0)
    halves = packed.qweight.view(n, -1, GROUP // 2)
    assert torch.equal(torch.cat([halves & 0x0F, halves >> 4], -1).float(), q)
    assert (packed.dequantize() - w).abs().max().item() <= 1e-6 * w.abs().max().item()


def test_encode_keeps_constant_groups() -> None:
    w = torch.full((3, 64), 0.25)
    packed = encode(w)
    assert packed is not None
    assert torch.equal(packed.dequantize(), w)


@pytest.mark.parametrize(
    "weight",
    [torch.randn(64, 576), torch.randn(64, 576).half().float(), torch.randn(8, 40)],
    ids=["normal", "fp16-normal", "k-not-multiple-of-32"],
)
def test_encode_rejects_non_q4_weights(weight: torch.Tensor) -> None:
    assert encode(weight) is None


def test_encode_rejects_one_off_weight() -> None:
    w = q4_1_weight(16, 64)[0]
    w[5, 17] += 1e-3
    assert encode(w) is None


needs_kernel = pytest.mark.skipif(not kernel_available(), reason="the Q4 C++ kernel could not be built here")


@needs_kernel
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_q4_linear_matches_matmul(n: int, k: int) -> None:
    w = q4_1_weight(n, k, seed=n + k)[0]
    packed = encode(w)
    assert packed is not None
    g = torch.Generator().manual_seed(1)
    for rows in range(1, 34):
        x = torch.randn(rows, k, generator=g)
        expected = (x.double() @ w.double().T).float()
        got = q4_linear(x, packed)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item(), rows


@needs_kernel
def test_q4_linear_batched_strided_and_empty_inputs() -> None:
    w = q4_1_weight(48, 96)[0]
    packed = encode(w)
    assert packed is not None
    x = torch.randn(2, 5, 192)[..., ::2]  # non-contiguous, 3-D
    torch.testing.assert_close(q4_linear(x, packed), x @ w.T, rtol=1e-4, atol=1e-4)
    assert q4_linear(torch.empty(0, 96), packed).shape == (0, 48)
    with pytest.raises(ValueError, match="features"):
        q4_linear(torch.randn(3, 64), packed)


def test_default_model_q4_1_layers_encode_exactly(default_model) -> None:
    """The projections are Q4_1 in the default GGUF; the Q8_0 embedding (= tied lm_head) is not.

    First, middle and last layer only: touching all 540 MB of weights costs seconds on a loaded machine.
    """
    model = default_model.model
    for i in (0, len(model.layers) // 2, len(model.layers) - 1):
        layer = model.layers[i]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            packed = encode(linear.weight.data)
            assert packed is not None, (i, tuple(linear.weight.shape))
            w = linear.weight.data.float()
            assert (packed.dequantize() - w).abs().max().item() <= 1e-6 * w.abs().max().item() + 1e-7
    assert encode(model.lm_head.weight.data) is None
    layer = model.layers[0]
    if kernel_available():
        w = layer.mlp.gate_up_proj.weight.data.float()
        packed = encode(w)
        assert packed is not None
        x = torch.randn(5, w.shape[1])
        expected = (x.double() @ w.double().T).float()
        assert (q4_linear(x, packed) - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
