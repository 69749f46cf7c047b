"""Exact checkpoint codes (Q4_1, Q8_0) are recovered bit for bit, and the panel GEMM is a GEMM.

References are independent of the code under test: weights built from known (d, q, m) codes the way
GGUF de-quantises them, and plain ``x @ w.T`` in float64.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams, kernels
from pagedkv.extension import cpu_flags
from pagedkv.model import panel
from pagedkv.model.codes import GROUP, Q4_LEVELS, Q8_LEVELS, encode_q4, encode_q8

SHAPES = [(960, 576), (576, 1536), (37, 96), (16, 32)]


def q4_1_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, q, d, m)`` with ``w = d * q + m`` (fp16-valued d and m) and q spanning 0..15 in every group.

    llama.cpp's Q4_1 quantiser maps a group's min to q = 0 and its max to q = 15, so real groups hold both.
    """
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // GROUP, generator=g) * 0.15).half().float()
    q = torch.randint(0, Q4_LEVELS + 1, (n, k // GROUP, GROUP), generator=g).float()
    pos = torch.randperm(GROUP, generator=g)[:2]
    q[..., pos[0]], q[..., pos[1]] = 0, Q4_LEVELS
    w = (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(n, k)
    return w, q.reshape(n, k), d, m


def q8_0_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, q, d)`` with ``w = q * d``, fp16 d, and every group reaching |q| = 127 as Q8_0 groups do."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.001 + 1e-4).half().float()
    q = torch.randint(-Q8_LEVELS, Q8_LEVELS + 1, (n, k // GROUP, GROUP), generator=g).float()
    q[..., 3] = Q8_LEVELS * torch.where(torch.rand(n, k // GROUP, generator=g) < 0.5, -1.0, 1.0)
    return (q * d.unsqueeze(-1)).reshape(n, k), q.reshape(n, k), d


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_codes_are_recovered_bit_for_bit(n: int, k: int) -> None:
    w, q, d, m = q4_1_weight(n, k)
    codes, d_got, m_got = encode_q4(w)
    assert torch.equal(codes.float(), q) and torch.equal(d_got, d) and torch.equal(m_got, m)
    w8, q8, d8 = q8_0_weight(n, k)
    codes8, d8_got = encode_q8(w8)
    assert torch.equal(codes8.float(), q8) and torch.equal(d8_got, d8)


def test_constant_and_zero_groups_are_kept() -> None:
    for w in (torch.full((3, 64), 0.25), torch.zeros(2, 32)):
        codes, d, m = encode_q4(w)
        assert torch.equal(codes.float().view(-1, 32) * d.view(-1, 1) + m.view(-1, 1), w.view(-1, 32))
    assert torch.equal(encode_q8(torch.zeros(2, 32))[0], torch.zeros(2, 32, dtype=torch.int8))


@pytest.mark.parametrize(
    "weight",
    [torch.randn(64, 576), torch.randn(64, 576).half().float(), torch.randn(8, 40)],
    ids=["normal", "fp16-normal", "k-not-multiple-of-32"],
)
def test_uncoded_weights_are_rejected(weight: torch.Tensor) -> None:
    assert encode_q4(weight) is None and encode_q8(weight) is None


def test_one_changed_weight_is_rejected() -> None:
    w = q4_1_weight(100, 64)[0]
    w[80, 17] += 1e-3  # beyond the 64 probe rows: the full check must catch it
    assert encode_q4(w) is None
    w8 = q8_0_weight(16, 64)[0]
    w8[5, 17] = torch.nextafter(w8[5, 17], torch.tensor(1.0))  # one ulp
    assert encode_q8(w8) is None


needs_kernel = pytest.mark.skipif(not kernels.gemm.available(), reason="the panel kernel could not be built here")


def _weights(n: int, k: int) -> dict[str, torch.Tensor]:
    return {"fp32": torch.randn(n, k) * 0.05, "q4": q4_1_weight(n, k, seed=n)[0], "q8": q8_0_weight(n, k, seed=k)[0]}


@needs_kernel
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_panel_linear_matches_matmul(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(1)
    for fmt, w in _weights(n, k).items():
        packed = panel.pack(w, fmt)
        assert packed is not None and packed.n == n and packed.k == k
        for rows in [*range(1, 14), 31, 97, 200]:  # every register tile size, and more than one row block
            x = torch.randn(rows, k, generator=g)
            expected = x.double() @ w.double().T
            got = panel.panel_linear(x, packed)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            # fp32 rounding only: a sum of k products, each term ~|x||w|
            bound = 8 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T).max().item()
            assert (got.double() - expected).abs().max().item() <= bound, (fmt, rows)


@needs_kernel
def test_a_row_does_not_depend_on_its_batch() -> None:
    for fmt, w in _weights(48, 576).items():
        packed = panel.pack(w, fmt)
        x = torch.randn(40, 576)
        together = panel.panel_linear(x, packed)
        for i in (0, 5, 6, 39):
            assert torch.equal(panel.panel_linear(x[i : i + 1], packed)[0], together[i]), (fmt, i)
            assert torch.equal(panel.panel_linear(x[: i + 1], packed)[i], together[i]), (fmt, i)


# The paths of the private op torch.ops.pagedkv._panel_linear_path (csrc/panel_linear.cpp): the tiled
# GEMM (what serves > 8 rows), and the register kernels (<= 8 rows), 8 or 16 floats a register.
AUTO, TILED, AVX2, AVX512 = 0, 1, 2, 3
has_avx512 = "avx512f" in cpu_flags().split()
# Odd N (a padded last panel), K < 256, K not a multiple of 256 (a short last chunk) and, for fp32, of 32.
FEW_ROWS_SHAPES = [(960, 576), (37, 96), (50, 800), (33, 1536), (200, 600)]


def _coded_if_possible(n: int, k: int) -> dict[str, torch.Tensor]:
    """fp32, q4 and q8 weights; only fp32 where K is not a multiple of the 32-weight groups."""
    return _weights(n, k) if k % GROUP == 0 else {"fp32": torch.randn(n, k) * 0.05}


def _path(x: torch.Tensor, packed: panel.PanelWeight, path: int) -> torch.Tensor:
    return torch.ops.pagedkv._panel_linear_path(
        x, packed.packed, packed.n, packed.k, panel.FORMATS[packed.format], path
    )


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), FEW_ROWS_SHAPES)
def test_few_rows_equal_their_rows_in_a_big_call(n: int, k: int, threads: int) -> None:
    """Decode-size calls (the register kernels) give every row the bits the tiled path gives it at M = 64.

    Bitwise, as the determinism guarantee needs: whatever M (1-8 and 9, past the switch), wherever the
    rows sit in x, on 1 or 2 threads, fp32 / q4 / q8.
    """
    g = torch.Generator().manual_seed(n + k)
    for fmt, w in _coded_if_possible(n, k).items():
        packed = panel.pack(w, fmt)
        x = torch.randn(64, k, generator=g)
        together = panel.panel_linear(x, packed)
        assert torch.equal(together, _path(x, packed, TILED)), fmt  # 64 rows: the tiled path
        for rows in range(1, 10):
            for start in (0, 7, 64 - rows):
                got = panel.panel_linear(x[start : start + rows], packed)
                assert torch.equal(got, together[start : start + rows]), (fmt, rows, start)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), FEW_ROWS_SHAPES)
@pytest.mark.parametrize("path", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_register_kernels_equal_the_tiled_path(n: int, k: int, path: int, threads: int) -> None:
    """Each instruction set's register kernels, forced at any M (more than 8 rows: several row groups), give
    the tiled path's bits; so AVX-512 and AVX2 agree with each other too. AVX-512 only where the CPU has it."""
    if path == AVX512 and not has_avx512:
        pytest.skip("this CPU has no AVX-512F")
    g = torch.Generator().manual_seed(n * k)
    for fmt, w in _coded_if_possible(n, k).items():
        packed = panel.pack(w, fmt)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13):
            x = torch.randn(rows, k, generator=g)
            assert torch.equal(_path(x, packed, path), _path(x, packed, TILED)), (fmt, rows)


@needs_kernel
def test_codes_compute_with_exactly_their_weights() -> None:
    """A q4 / q8 panel gives the bits of an fp32 panel holding the de-quantised weights, on every path:
    ``d * q`` is exact (fp16 d, 4- or 8-bit q), so de-quantising rounds once whether or not the compiler
    fuses the multiply and the add."""
    paths = [TILED, AVX2] + ([AVX512] if has_avx512 else [])
    for fmt, w in (("q4", q4_1_weight(40, 544)[0]), ("q8", q8_0_weight(40, 544)[0])):
        coded, fp32 = panel.pack(w, fmt), panel.pack(w, "fp32")
        for rows in (1, 3, 12):
            x = torch.randn(rows, 544)
            for path in paths:
                assert torch.equal(_path(x, coded, path), _path(x, fp32, path)), (fmt, rows, path)


@needs_kernel
def test_rows_read_back_exactly_the_packed_weights() -> None:
    """panel.rows (the embedding lookup of a tied LM head whose panel holds the only copy) gives back the very
    weights that were packed, in every format, with a padded last panel and repeated ids."""
    ids = torch.tensor([0, 36, 15, 16, 36, 7])
    for fmt, w in (("fp32", torch.randn(37, 96)), ("q4", q4_1_weight(37, 96)[0]), ("q8", q8_0_weight(37, 96)[0])):
        assert torch.equal(panel.rows(panel.pack(w, fmt), ids), w[ids]), fmt
    with pytest.raises(ValueError, match=r"ids\[1\] = 37 is outside \[0, 37\)"):  # the padded lane is no row
        panel.rows(panel.pack(torch.randn(37, 96), "fp32"), torch.tensor([0, 37]))


@needs_kernel
def test_the_path_is_checked() -> None:
    packed = panel.pack(torch.randn(16, 32), "fp32")
    with pytest.raises(RuntimeError, match="unknown path"):
        _path(torch.randn(1, 32), packed, 4)
    if not has_avx512:
        with pytest.raises(RuntimeError, match="AVX-512"):
            _path(torch.randn(1, 32), packed, AVX512)


@needs_kernel
def test_panel_linear_strided_empty_and_bad_inputs() -> None:
    w = q4_1_weight(48, 96)[0]
    packed = panel.pack(w, "q4")
    x = torch.randn(2, 5, 192)[..., ::2]  # non-contiguous, 3-D
    torch.testing.assert_close(panel.panel_linear(x, packed), x @ w.T, rtol=1e-5, atol=1e-5)
    assert panel.panel_linear(torch.empty(0, 96), packed).shape == (0, 48)
    with pytest.raises(ValueError, match="features"):
        panel.panel_linear(torch.randn(3, 64), packed)
    with pytest.raises(ValueError, match="format"):
        panel.pack(w, "q2")
    assert panel.pack(torch.randn(8, 64), "q4") is None


def test_default_model_layers_hold_exact_codes(default_model) -> None:
    """The projections are Q4_1 in the default GGUF and the tied embedding / LM head is Q8_0.

    First, middle and last layer only: touching all 540 MB of weights costs seconds on a loaded machine.
    """
    model = default_model.model
    for i in (0, len(model.layers) // 2, len(model.layers) - 1):
        layer = model.layers[i]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            codes, d, m = encode_q4(linear.weight.data)
            n, k = linear.weight.shape
            rebuilt = codes.float().view(n, -1, GROUP) * d.unsqueeze(-1) + m.unsqueeze(-1)
            assert torch.equal(rebuilt.view(n, k), linear.weight.data), i
    head = model.lm_head.weight.data
    assert encode_q4(head) is None
    codes, d = encode_q8(head)
    assert torch.equal((codes.float().view(head.shape[0], -1, GROUP) * d.unsqueeze(-1)).view(head.shape), head)


@pytest.mark.slow
@needs_kernel
def test_q4_and_panel_engines_match_the_torch_gemm_engine() -> None:
    """Greedy chat answers of weight_format='gguf' and of fp32 on panels equal fp32 on torch's GEMM, token for
    token."""
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.", "hi"]
    chats = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0)
    answers = {}
    for name, options in {
        "torch": {"kernels": False},
        "panel": {"kernels": True},
        "q4": {"weight_format": "gguf", "kernels": True},
    }.items():
        llm = LLM(attention_backend="gather", max_num_seqs=4, **options)
        model = llm.engine.runner.model
        if name == "q4":  # the checkpoint's own codes: Q8_0 head, Q4_1 projections
            assert model.lm_head.panel.format == "q8" and model.layers[0].mlp.down_proj.panel.format == "q4"
        elif name == "panel":
            assert model.lm_head.panel.format == "fp32" and model.layers[0].mlp.down_proj.panel.format == "fp32"
        if name != "torch":  # one copy of the tied vocabulary matrix: the embedding reads the head's panel
            assert model.embed_tokens.numel() == 0 and model.lm_head.weight is model.embed_tokens
        answers[name] = [o.token_ids for o in llm.chat(chats, params, use_tqdm=False)]
        assert llm.engine.kv.num_used_blocks == 0
        del llm
    assert answers["panel"] == answers["torch"]
    assert answers["q4"] == answers["torch"]


def test_a_broken_compiler_falls_back_to_torch(monkeypatch, tmp_path, caplog) -> None:
    """No compiler: kernels resolve to torch's ops with one warning per library instead of failing the engine.

    (The torch path itself is what tests/test_engine_hf.py and tests/test_model_hf.py check against HF.)
    """
    import logging

    monkeypatch.setattr(kernels, "portable", kernels.portable.fresh())
    monkeypatch.setattr(kernels, "gemm", kernels.gemm.fresh())
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))  # an empty cache: the build is attempted
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING):
        assert kernels.use_kernels(None) is False
        assert kernels.use_kernels(True) is False
    assert sum("could not be built" in r.getMessage() for r in caplog.records) == 1
    assert any("kernels=True asked for" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="kernels=False"):
        panel.panel_linear(torch.randn(2, 32), panel.pack(torch.randn(16, 32), "fp32"))
    assert sum("could not be built" in r.getMessage() for r in caplog.records) == 2  # the GEMM's own attempt
    monkeypatch.setenv(kernels.ENV_VAR, "mkl")
    with pytest.raises(ValueError, match=kernels.ENV_VAR):
        kernels.use_kernels(None)


def test_without_avx2_only_the_gemm_is_lost(monkeypatch, tmp_path, caplog) -> None:
    """A CPU without AVX2 cannot build the panel GEMM (it #errors); the portable ops still build and run."""
    import logging

    def no_avx2() -> None:
        raise RuntimeError("panel_linear.cpp:33: error: #error panel_linear needs AVX2 and FMA")

    monkeypatch.setattr(kernels, "gemm", kernels.gemm.fresh())
    monkeypatch.setattr(kernels.gemm, "build", no_avx2)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    if not kernels.portable.available():
        pytest.skip("the portable ops could not be built here")
    with caplog.at_level(logging.WARNING):
        assert kernels.use_kernels(True) is True
    assert any("panel GEMM ops (AVX2 + FMA) could not be built" in r.getMessage() for r in caplog.records)
    x = torch.randn(3, 64)
    torch.testing.assert_close(kernels.silu_mul(x), torch.nn.functional.silu(x[:, :32]) * x[:, 32:])
