"""The panel GEMM is a GEMM, in every
panel format (fp32, f16, bf16, the quantised q4, q8, q8m, q4g16, q8g16 and the compact q4k, q6k, q5, q5k).

References are independent of the code under test: weights built from known (d, q, m) codes the way
GGUF de-quantises them (in fp32 torch), random GGUF blocks de-quantised by gguf's numpy code, half-precision
values widened by torch, and plain ``x @ w.T`` in float64; and, bit for bit, an fp32 panel holding those
weights.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams, kernel_ops, kernels
from pagedkv.extension import cpu_flags
from pagedkv.model import gguf_blocks, panel
from tests.model.test_gguf_blocks import random_blocks, reference

SHAPES = [(960, 576), (576, 1536), (37, 96), (16, 32)]
GROUP, Q4_LEVELS, Q8_LEVELS = 32, 15, 127  # a Q4_1 / Q8_0 group's weights, and their codes' largest values


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


needs_kernel = pytest.mark.skipif(not kernels.gemm.available(), reason="the panel kernel could not be built here")


def _fp16_values(shape: tuple[int, ...], g: torch.Generator, extreme: bool) -> torch.Tensor:
    """Non-negative fp16 values as fp32: model-sized ones, or (``extreme``) any finite fp16, subnormals and the
    largest (65504) included."""
    if not extreme:
        return (torch.rand(shape, generator=g) * 0.02).half().float()
    values = torch.randint(0, 0x7C00, shape, generator=g, dtype=torch.int16).view(torch.float16).float()
    values.view(-1)[:2] = torch.tensor([65504.0, 2.0**-24])  # the largest and the smallest (subnormal) fp16
    return values


def coded_weight(
    fmt: str, n: int, k: int, seed: int = 0, extreme: bool = False
) -> tuple[torch.Tensor, panel.PanelWeight]:
    """``(w, packed)``: codes spanning the format's whole range, packed with :func:`panel.pack_codes`, and
    ``w = d * q (+ m)`` computed by torch in fp32 (multiply, then add: gguf's numpy de-quantiser).

    ``d`` is an fp16 value times a 6-bit sub-block scale, as the K-quants build it (up to 17 significant
    bits), of either sign; ``m`` likewise. With a min, ``d * q`` is then still exact (q has at most 7
    significant bits), as formats.md requires.
    """
    bits, group, has_min = panel.CODED[fmt]
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    low, high = (0, 15) if bits == 4 else (-128, 127)
    q = torch.randint(low, high + 1, (n, k), generator=g)
    q.view(-1)[:2] = torch.tensor([low, high])

    def scale() -> torch.Tensor:
        sign = torch.where(torch.rand(n, groups, generator=g) < 0.5, -1.0, 1.0)
        return _fp16_values((n, groups), g, extreme) * torch.randint(1, 64, (n, groups), generator=g) * sign

    d = scale()
    if extreme:
        d[-1, -1] = 65504.0 * 63  # the largest K-quant d
    m = scale() if has_min else None
    w = q.view(n, groups, group).float() * d.unsqueeze(-1)
    if m is not None:
        w = w + m.unsqueeze(-1)
    return w.reshape(n, k), panel.pack_codes(q, d, m, fmt)


def half_weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, panel.PanelWeight]:
    """``(w, packed)`` for random half-precision bits of either sign, subnormals included: any finite fp16;
    bf16 below 2^99, so that sums of products with x stay finite (an inf or NaN compares unequal to itself)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 0x7C00 if fmt == "f16" else 0x7100, (n, k), generator=g, dtype=torch.int16)
    bits |= torch.where(torch.rand(n, k, generator=g) < 0.5, -0x8000, 0).to(torch.int16)  # the sign bit
    return bits.view(panel.HALF[fmt]).float(), panel.pack_half(bits, fmt)


def gguf_weight(ggml_type: int, fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, panel.PanelWeight]:
    """``(w, packed)`` for random blocks of a GGUF type: ``w`` as gguf's numpy code de-quantises them,
    ``packed`` by :func:`gguf_blocks.pack` in ``fmt``. Every code and sub-block scale turns up, and the blocks'
    fp16 scales are model-sized but for the first few: fp16's largest, its smallest subnormal and zeros, of
    either sign (tests/model/test_gguf_blocks.py)."""
    raw = random_blocks(ggml_type, n, k, seed)
    return reference(raw, ggml_type, n, k), gguf_blocks.pack(raw, ggml_type, n, k, fmt)


def _panels(n: int, k: int, extreme: bool = False) -> dict[str, tuple[torch.Tensor, panel.PanelWeight]]:
    """Every format whose group (or block) divides ``k``: ``fmt -> (w, packed)``. fp32, and q4 / q8 with
    model-like Q4_1 / Q8_0 codes unless ``extreme``; the others from their codes, bits or GGUF blocks (whose
    scales include extremes either way)."""
    w = torch.randn(n, k) * 0.05
    out = {"fp32": (w, panel.pack_fp32(w))}
    if k % GROUP == 0 and not extreme:
        w4, q4, d4, m4 = q4_1_weight(n, k, seed=n)
        w8, q8, d8 = q8_0_weight(n, k, seed=k)
        out["q4"] = (w4, panel.pack_codes(q4.to(torch.uint8), d4, m4, "q4"))
        out["q8"] = (w8, panel.pack_codes(q8.to(torch.int8), d8, None, "q8"))
    for fmt, (_, group, _) in panel.CODED.items():
        if k % group == 0 and fmt not in out:
            out[fmt] = coded_weight(fmt, n, k, seed=n + k, extreme=extreme)
    for ggml_type, block in gguf_blocks.TYPES.items():
        for fmt in block.formats:
            if fmt in panel.COMPACT and k % block.block_size == 0:
                out[fmt] = gguf_weight(ggml_type, fmt, n, k, seed=n + k + extreme)
    return out | {fmt: half_weight(fmt, n, k, seed=n * k) for fmt in panel.HALF}


@needs_kernel
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_panel_linear_matches_matmul(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(1)
    for fmt, (w, packed) in _panels(n, k).items():
        assert packed.n == n and packed.k == k
        for rows in [*range(1, 14), 31, 97, 200]:  # every register tile size, and more than one row block
            x = torch.randn(rows, k, generator=g)
            expected = x.double() @ w.double().T
            got = panel.panel_linear(x, packed)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            # fp32 rounding only: a sum of k products, each term ~|x||w|
            bound = 8 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T).max().item()
            assert (got.double() - expected).abs().max().item() <= bound, (fmt, rows)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(48, 576), (40, 512)])
def test_a_row_does_not_depend_on_its_batch(n: int, k: int) -> None:
    for fmt, (_, packed) in _panels(n, k).items():
        x = torch.randn(40, k)
        together = panel.panel_linear(x, packed)
        for i in (0, 5, 6, 39):
            assert torch.equal(panel.panel_linear(x[i : i + 1], packed)[0], together[i]), (fmt, i)
            assert torch.equal(panel.panel_linear(x[: i + 1], packed)[i], together[i]), (fmt, i)


# The paths of the private ops torch.ops.pagedkv._panel_linear_path and _panel_linear_into_path
# (csrc/panel_linear.cpp): the tiled GEMM (what serves > 8 rows), and the register kernels (<= 8 rows), 8 or
# 16 floats a register.
AUTO, TILED, AVX2, AVX512 = 0, 1, 2, 3
has_avx512 = "avx512f" in cpu_flags().split()
PATHS = [TILED, AVX2] + ([AVX512] if has_avx512 else [])
# Odd N (a padded last panel), K < 256, K not a multiple of 256 (a short last chunk) and, for the float
# formats, of the groups (16 or 32).
FEW_ROWS_SHAPES = [(960, 576), (37, 96), (50, 800), (33, 1536), (200, 600)]


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
    rows sit in x, on 1 or 2 threads, in every format.
    """
    g = torch.Generator().manual_seed(n + k)
    for fmt, (_, packed) in _panels(n, k).items():
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
    for fmt, (_, packed) in _panels(n, k).items():
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13):
            x = torch.randn(rows, k, generator=g)
            assert torch.equal(_path(x, packed, path), _path(x, packed, TILED)), (fmt, rows)


def _exact_grid_values(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Integers below 2^11 in magnitude times 2^-3..2^3: products and their sums over K <= 1536 are exact in
    float64 (on a 2^-6 grid, below 2^39), so float64 math followed by one rounding to float32 is a true fp32
    FMA or add; and fp32 sums of them round, so the summation order shows in the bits."""
    ints = torch.randint(-(2**11), 2**11, shape, generator=g).double()
    return (ints * torch.pow(2.0, torch.randint(-3, 4, shape, generator=g).double())).float()


def _ordered_sums(x: torch.Tensor, w: torch.Tensor, partials: int) -> torch.Tensor:
    """x @ w.T in the panel GEMM's order (the header of csrc/panel_linear.cpp), in torch: per 256-k chunk,
    partial j chains fp32 FMAs from zero over the chunk's k = j mod ``partials``, ascending; the chunk's sum is
    the partials added in order; the chunk sums join the total in chunk order. Exact emulation for
    :func:`_exact_grid_values` inputs."""
    xd, wd = x.double(), w.double()
    total = None
    for k0 in range(0, x.shape[1], 256):
        chunk = None
        for j in range(partials):
            acc = torch.zeros(x.shape[0], w.shape[0])
            for k in range(k0 + j, min(k0 + 256, x.shape[1]), partials):
                acc = (acc.double() + xd[:, k, None] * wd[None, :, k]).float()  # one rounding: an FMA
            chunk = acc if chunk is None else chunk + acc
        total = chunk if total is None else total + chunk
    return total


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(37, 600), (20, 37), (16, 1536)])
def test_every_path_sums_in_the_documented_order(n: int, k: int, threads: int) -> None:
    """Every path gives, bit for bit, the sums of the order the header documents (two interleaved partial sums
    per 256-k chunk): chunk tails, odd K and a padded last panel included. The order matters for these
    inputs: one chain per chunk (the order before) gives other bits."""
    g = torch.Generator().manual_seed(n + k)
    w = _exact_grid_values((n, k), g)
    packed = panel.pack_fp32(w)
    x = _exact_grid_values((13, k), g)
    want = _ordered_sums(x, w, partials=2)
    assert not torch.equal(want, _ordered_sums(x, w, partials=1))
    for path in PATHS:
        for rows in (1, 2, 3, 4, 5, 13):
            assert torch.equal(_path(x[:rows], packed, path), want[:rows]), (path, rows)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(37, 800), (75, 96), (19, 600), (21, 512)])
@pytest.mark.parametrize("extreme", [False, True], ids=["model-scales", "extreme-scales"])
def test_codes_compute_with_exactly_their_weights(n: int, k: int, extreme: bool, threads: int) -> None:
    """A coded or half-precision panel gives the bits of an fp32 panel holding its decoded weights, on every
    path, at 1-13 rows: every format computes with exactly gguf's weights, in fp32. With a min, ``d * q`` is
    exact, so de-quantising rounds once whether or not it is fused; without one, ``d * q`` rounds once (as in
    torch) before it meets x. Extreme scales: d from fp16's smallest subnormal to 65504 * 63."""
    g = torch.Generator().manual_seed(k)
    for fmt, (w, packed) in _panels(n, k, extreme).items():
        if fmt == "fp32":
            continue
        fp32 = panel.pack_fp32(w)
        for rows in range(1, 14):
            x = torch.randn(rows, k, generator=g)
            for path in PATHS:
                assert torch.equal(_path(x, packed, path), _path(x, fp32, path)), (fmt, rows, path)


@needs_kernel
@pytest.mark.parametrize("extreme", [False, True], ids=["model-scales", "extreme-scales"])
def test_rows_read_back_exactly_the_packed_weights(extreme: bool) -> None:
    """panel.rows (the embedding lookup of a tied LM head whose panel holds the only copy) gives back the very
    weights that were packed, bit for bit (the sign of a zero included), in every format, with a padded last
    panel and repeated ids."""
    ids = torch.tensor([0, 36, 15, 16, 36, 7])
    for k in (96, 256):
        for fmt, (w, packed) in _panels(37, k, extreme).items():
            assert torch.equal(panel.rows(packed, ids).view(torch.int32), w[ids].view(torch.int32)), fmt
    with pytest.raises(ValueError, match=r"ids\[1\] = 37 is outside \[0, 37\)"):  # the padded lane is no row
        panel.rows(panel.pack_fp32(torch.randn(37, 96)), torch.tensor([0, 37]))


def _into(x: torch.Tensor, packed: panel.PanelWeight, y: torch.Tensor, col: int, path: int) -> None:
    torch.ops.pagedkv._panel_linear_into_path(
        x, packed.packed, packed.n, packed.k, panel.FORMATS[packed.format], y, col, path
    )


@needs_kernel
@pytest.mark.parametrize("k", [800, 600, 512])
def test_panel_linear_into_writes_exactly_its_columns(k: int, threads: int) -> None:
    """panel_linear_into fills columns [col, col + n) of a wider y with panel_linear's bits, on every path, and
    leaves the other columns alone (an odd n: the padded last panel must not spill over)."""
    n, width, col = 37, 50, 5
    for fmt, (_, packed) in _panels(n, k).items():
        for rows in (1, 5, 13):
            x = torch.randn(rows, k)
            want = panel.panel_linear(x, packed)
            for path in (AUTO, *PATHS):
                y = torch.full((rows, width), float("nan"))
                _into(x, packed, y, col, path)
                assert torch.equal(y[:, col : col + n], want), (fmt, rows, path)
                assert y[:, :col].isnan().all() and y[:, col + n :].isnan().all(), (fmt, rows, path)


@needs_kernel
def test_a_fused_layer_runs_its_parts_in_their_formats_into_one_output() -> None:
    """q|k|v packed apart in three formats: one panel_linear_into per part gives each part's own results."""
    parts = [coded_weight("q8g16", 64, 576)[1], half_weight("bf16", 21, 576)[1], coded_weight("q4", 43, 576)[1]]
    for rows in (1, 7, 20):
        x = torch.randn(rows, 576)
        y = torch.empty(rows, sum(p.n for p in parts))
        col = 0
        for part in parts:
            panel.panel_linear_into(x, part, y, col)
            col += part.n
        assert torch.equal(y, torch.cat([panel.panel_linear(x, p) for p in parts], dim=1)), rows


@needs_kernel
def test_bad_codes_and_outputs_are_refused() -> None:
    q, d, m = torch.randint(0, 16, (16, 64)), torch.rand(16, 2), torch.rand(16, 2)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 15\]"):
        panel.pack_codes(q + 1, d, m, "q4")
    with pytest.raises(ValueError, match="and no m"):
        panel.pack_codes(q, d, m, "q8")
    with pytest.raises(ValueError, match="d and m"):
        panel.pack_codes(q, d, None, "q8m")
    with pytest.raises(ValueError, match="multiple of 32"):
        panel.pack_codes(q[:, :48], d, m, "q4")
    with pytest.raises(ValueError, match="float16"):
        panel.pack_half(torch.zeros(4, 8, dtype=torch.bfloat16), "f16")
    packed = panel.pack_codes(q, d, m, "q4")
    with pytest.raises(ValueError, match="multiple of 32"):  # the C++ check, for a caller that skips panel.py
        torch.ops.pagedkv.panel_linear(torch.randn(1, 48), packed.packed, 16, 48, panel.FORMATS["q4"])
    with pytest.raises(ValueError, match="unknown format 14"):
        torch.ops.pagedkv.panel_linear(torch.randn(1, 64), packed.packed, 16, 64, 14)
    with pytest.raises(ValueError, match="multiple of 256"):
        torch.ops.pagedkv.panel_linear(torch.randn(1, 64), packed.packed, 16, 64, panel.FORMATS["q4k"])
    x = torch.randn(3, 64)
    for y, col in ((torch.empty(3, 20), 5), (torch.empty(3, 40)[:, ::2], 0), (torch.empty(2, 16), 0)):
        with pytest.raises(RuntimeError, match="panel_linear: "):
            panel.panel_linear_into(x, packed, y, col)


@needs_kernel
def test_the_path_is_checked() -> None:
    packed = panel.pack_fp32(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="unknown path"):
        _path(torch.randn(1, 32), packed, 4)
    if not has_avx512:
        with pytest.raises(RuntimeError, match="AVX-512"):
            _path(torch.randn(1, 32), packed, AVX512)


@needs_kernel
def test_panel_linear_strided_empty_and_bad_inputs() -> None:
    w, q, d, m = q4_1_weight(48, 96)
    packed = panel.pack_codes(q.to(torch.uint8), d, m, "q4")
    x = torch.randn(2, 5, 192)[..., ::2]  # non-contiguous, 3-D
    torch.testing.assert_close(panel.panel_linear(x, packed), x @ w.T, rtol=1e-5, atol=1e-5)
    assert panel.panel_linear(torch.empty(0, 96), packed).shape == (0, 48)
    with pytest.raises(ValueError, match="features"):
        panel.panel_linear(torch.randn(3, 64), packed)
    with pytest.raises(ValueError, match="fp32 weight"):
        panel.pack_fp32(w.half())


@needs_kernel
def test_the_default_model_computes_on_the_files_own_codes(hf_default_model) -> None:
    """Loaded natively, the default model's projections are its file's Q4_1 codes (q4) and its tied head the
    Q8_0 ones (q8), and the weights they hold read back as HF's (transformers de-quantises the file with
    gguf's numpy code), bit for bit. First, middle and last layer, and the head."""
    from pagedkv.model.loader import load_model

    ours, theirs = load_model(None, kernels=True).model, hf_default_model.model

    def held(linear) -> torch.Tensor:
        return torch.cat([panel.rows(part, torch.arange(part.n)) for part in linear.panels])

    for i in (0, len(ours.layers) // 2, len(ours.layers) - 1):
        a, b = ours.layers[i], theirs.layers[i]
        for linear, refs in (
            (a.self_attn.qkv_proj, (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj)),
            (a.self_attn.o_proj, (b.self_attn.o_proj,)),
            (a.mlp.gate_up_proj, (b.mlp.gate_proj, b.mlp.up_proj)),
            (a.mlp.down_proj, (b.mlp.down_proj,)),
        ):
            assert {part.format for part in linear.panels} == {"q4"}, i  # a part per fused projection
            want = torch.cat([ref.weight.detach() for ref in refs])
            assert torch.equal(held(linear).view(torch.int32), want.view(torch.int32)), i
    assert [part.format for part in ours.lm_head.panels] == ["q8"]
    head = hf_default_model.lm_head.weight.detach()
    assert torch.equal(held(ours.lm_head).view(torch.int32), head.view(torch.int32))


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
        "torch": {"weight_format": "float32", "kernels": False},
        "panel": {"weight_format": "float32", "kernels": True},
        "q4": {"weight_format": "gguf", "kernels": True},  # the default for the default model's .gguf
    }.items():
        llm = LLM(attention_backend="gather", max_num_seqs=4, **options)
        model = llm.engine.runner.model
        if name == "q4":  # the checkpoint's own codes: Q8_0 head, Q4_1 projections
            assert model.lm_head.panels[0].format == "q8" and model.layers[0].mlp.down_proj.panels[0].format == "q4"
        elif name == "panel":
            assert model.lm_head.panels[0].format == "fp32" and model.layers[0].mlp.down_proj.panels[0].format == "fp32"
        if name != "torch":  # one copy of the tied vocabulary matrix: the embedding reads the head's panel
            assert model.embed_tokens.numel() == 0 and model.lm_head.weight.numel() == 0
        answers[name] = [o.token_ids for o in llm.chat(chats, params, use_tqdm=False)]
        assert llm.engine.kv.num_used_blocks == 0
        del llm
    assert answers["panel"] == answers["torch"]
    assert answers["q4"] == answers["torch"]


def test_a_broken_compiler_falls_back_to_torch(monkeypatch, tmp_path, caplog) -> None:
    """No compiler: kernels resolve to torch's ops with one warning per library instead of failing the engine.

    (The torch path itself is what tests/system/test_engine_hf.py and tests/model/test_model_hf.py check against HF.)
    """
    import logging

    monkeypatch.setattr(kernels, "portable", kernels.portable.fresh())
    monkeypatch.setattr(kernels, "gemm", kernels.gemm.fresh())
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))  # an empty cache: the build is attempted
    monkeypatch.setenv(kernels.VARIANT_ENV, "jit")  # not loaded from a checkout's build/ (make wheel)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING):
        assert kernels.use_kernels(None) is False
        assert kernels.use_kernels(True) is False
        assert kernels.gemm.available() is False  # its build was started beside the portable library's
    assert sum("could not be built" in r.getMessage() for r in caplog.records) == 2
    assert any("kernels=True asked for" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="kernels=False"):
        panel.panel_linear(torch.randn(2, 32), panel.pack_fp32(torch.randn(16, 32)))
    assert sum("could not be built" in r.getMessage() for r in caplog.records) == 2  # not attempted again
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
    torch.testing.assert_close(kernel_ops.silu_mul(x), torch.nn.functional.silu(x[:, :32]) * x[:, 32:])
