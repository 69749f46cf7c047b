"""All linear layers of one step of the default model: MKL (torch) against the panel GEMM, fp32 and exact codes.

    python benchmarks/panel_linear.py [--threads 2] [--rows 1 4 9 16 32 128 724] [--quick] [--avx2]
                                      [--formats [fp32 q4 ...]] [--format-rows 1 16 128]

A step runs 30 layers x (qkv, o, gate_up, down) plus the LM head on M rows (M = batch size when decoding,
prompt tokens when prefilling). Each candidate runs all 121 of them, on separate weight copies like a real
step (more than the last-level cache holds), and every result is checked against MKL first:

- ``mkl``: torch's GEMM on the row-major fp32 weights, in the faster of ``x W^T`` and ``(W x^T)^T``.
- ``panel fp32``: ``pagedkv.model.panel`` on the same weights, packed 16 outputs a panel.
- ``panel q4``: the exact Q4_1 codes of the projections and Q8_0 codes of the head (the default GGUF's).

Up to 8 rows the panel GEMM runs its register kernels (AVX-512 where the CPU has it; ``--avx2`` forces the
AVX2 ones); ``fp32_tiled_ms`` and ``q4_tiled_ms`` time its tiled path on the same rows, the one that served
every M before (``-`` above 8 rows, where it is what runs). ``q4_GBps`` is the q4 weights' bytes over
``panel_q4_ms``, and ``read_q4_ms`` the time torch takes just to read those bytes (a sum over them, as one
call per layer): the memory speed a one-row step cannot beat.

The weights are synthetic but coded like the GGUF file's (Q4_1 projections, a Q8_0 head), packed from their codes.

With ``--formats`` (all of them if none is named: fp32, the half-precision ones and every quantised one a
GGUF file's types are packed into), a second table runs the same step with every weight in one panel format,
at ``--format-rows`` rows: each format's time, and at one row the GB/s it reads its weights at (its bytes over
its time). The codes are random, in each format's range; the time does not depend on their values. The
compact formats (q4k, q6k, q5, q5k) run when named, once the kernel computes them; q4k, q6k and q5k hold
256-weight blocks, so with one among them every format runs with K rounded up to 256 (576 -> 768), so that all
read the same weights.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, setup_threads, time_interleaved  # noqa: E402

from pagedkv import kernels  # noqa: E402
from pagedkv.extension import cpu_flags  # noqa: E402
from pagedkv.model import gguf_blocks, panel  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down of SmolLM2-135M
HEAD_SHAPE = (49152, 576)
GROUP, Q4_LEVELS, Q8_LEVELS = 32, 15, 127  # a Q4_1 / Q8_0 group's weights, and their codes' largest values


def q4_coded(n: int, k: int) -> tuple[torch.Tensor, panel.PanelWeight]:
    """``(w, packed)``: ``w = d * q + m`` with fp16 d, m and every group spanning q = 0..15, as llama.cpp's Q4_1
    quantiser writes, and its codes packed as q4."""
    d = (torch.rand(n, k // GROUP) * 0.01).half().float()
    m = (-torch.rand(n, k // GROUP) * 0.08).half().float()
    q = torch.randint(0, Q4_LEVELS + 1, (n, k // GROUP, GROUP)).float()
    q[..., 0], q[..., -1] = 0, Q4_LEVELS
    w = (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(n, k)
    return w, panel.pack_codes(q.reshape(n, k).to(torch.uint8), d, m, "q4")


def q8_coded(n: int, k: int) -> tuple[torch.Tensor, panel.PanelWeight]:
    """``(w, packed)``: ``w = q * d`` with fp16 d and |q| reaching 127 in every group, as Q8_0 writes, and its
    codes packed as q8."""
    d = (torch.rand(n, k // GROUP) * 0.001 + 1e-4).half().float()
    q = torch.randint(-Q8_LEVELS, Q8_LEVELS + 1, (n, k // GROUP, GROUP)).float()
    q[..., 0] = Q8_LEVELS
    return (q * d.unsqueeze(-1)).reshape(n, k), panel.pack_codes(q.reshape(n, k).to(torch.int8), d, None, "q8")


# The GGUF type each compact format holds, and the byte offsets of its blocks' fp16 scale fields (d, dmin;
# gguf/quants.py's dequantize_blocks)
COMPACT_TYPES = {
    "q4k": (GGMLQuantizationType.Q4_K, (0, 2)),
    "q6k": (GGMLQuantizationType.Q6_K, (208,)),
    "q5": (GGMLQuantizationType.Q5_0, (0,)),
    "q5k": (GGMLQuantizationType.Q5_K, (0, 2)),
    "q2k": (GGMLQuantizationType.Q2_K, (80, 82)),
    "q3k": (GGMLQuantizationType.Q3_K, (108,)),
}


def gguf_coded(fmt: str, n: int, k: int) -> panel.PanelWeight:
    """Random blocks of the GGUF type compact format ``fmt`` holds, fp16 scales model-sized, packed from them."""
    ggml_type, fp16_fields = COMPACT_TYPES[fmt]
    block = gguf_blocks.TYPES[ggml_type]
    raw = torch.randint(0, 256, (n * k // block.block_size, block.type_size), dtype=torch.uint8)
    for offset in fp16_fields:
        raw[:, offset : offset + 2] = (torch.rand(len(raw)) * 1e-3).half().view(torch.uint8).view(-1, 2)
    return gguf_blocks.pack(raw.view(n, -1), ggml_type, n, k, fmt)


def format_coded(fmt: str, n: int, k: int) -> panel.PanelWeight:
    """A weight ``[n, k]`` in panel format ``fmt``: model-sized values, or random codes with fp16-valued scales."""
    if fmt in panel.COMPACT:
        return gguf_coded(fmt, n, k)
    if fmt == "fp32":
        return panel.pack_fp32(torch.randn(n, k) * 0.05)
    if fmt in panel.HALF:
        return panel.pack_half((torch.randn(n, k) * 0.05).to(panel.HALF[fmt]), fmt)
    bits, group, has_min = panel.CODED[fmt]
    q = torch.randint(0, 16, (n, k)) if bits == 4 else torch.randint(-128, 128, (n, k))
    d = (torch.rand(n, k // group) * 0.01).half().float()
    m = (-torch.rand(n, k // group) * 0.08).half().float() if has_min else None
    return panel.pack_codes(q, d, m, fmt)


# The paths of torch.ops.pagedkv._panel_linear_path (csrc/panel_linear.cpp).
AUTO, TILED, AVX2 = 0, 1, 2
REGISTER_ROWS = 8  # up to which the panel GEMM picks its register kernels


def mkl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t() if 8 <= x.shape[0] <= 512 else F.linear(x, w)


def panel_path(x: torch.Tensor, p: panel.PanelWeight, path: int) -> torch.Tensor:
    return torch.ops.pagedkv._panel_linear_path(x, p.packed, p.n, p.k, panel.FORMATS[p.format], path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 9, 16, 32, 128, 724])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="4 layers, few repeats")
    parser.add_argument("--avx2", action="store_true", help="the AVX2 register kernels even where AVX-512 runs")
    parser.add_argument(
        "--formats",
        nargs="*",
        choices=list(panel.FORMATS),
        help="also time each format alone (all of them if none named)",
    )
    parser.add_argument("--format-rows", type=int, nargs="*", default=[1, 16, 128])
    args = parser.parse_args()
    setup_threads(args.threads)
    if not kernels.gemm.available():
        raise SystemExit("the panel kernel could not be built; see the warning above")
    layers = 4 if args.quick else args.layers
    weights, coded = zip(*[q4_coded(n, k) for _ in range(layers) for n, k in LAYER_SHAPES], q8_coded(*HEAD_SHAPE))
    fp32 = [panel.pack_fp32(w) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    q4_bytes = sum(p.nbytes for p in coded)
    as_floats = [p.packed.view(torch.float32) for p in coded]  # the same bytes, for torch to read
    table = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        path = AVX2 if args.avx2 and rows <= REGISTER_ROWS else AUTO
        candidates = {
            "mkl": lambda xs=xs: [mkl(xs[w.shape[1]], w) for w in weights],
            "panel fp32": lambda xs=xs, path=path: [panel_path(xs[p.k], p, path) for p in fp32],
            "panel q4": lambda xs=xs, path=path: [panel_path(xs[p.k], p, path) for p in coded],
        }
        if rows <= REGISTER_ROWS:
            candidates["fp32 tiled"] = lambda xs=xs: [panel_path(xs[p.k], p, TILED) for p in fp32]
            candidates["q4 tiled"] = lambda xs=xs: [panel_path(xs[p.k], p, TILED) for p in coded]
        candidates["read q4"] = lambda: [t.sum() for t in as_floats]
        reference = candidates["mkl"]()
        for name in ("panel fp32", "panel q4"):
            for got, want in zip(candidates[name](), reference, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for name, same_as in (("fp32 tiled", "panel fp32"), ("q4 tiled", "panel q4")):
            if name in candidates:  # the paths sum in one order: the same bits
                for got, want in zip(candidates[name](), candidates[same_as](), strict=True):
                    assert torch.equal(got, want), name
        repeats = 3 if args.quick or rows > 200 else 7
        us = time_interleaved(candidates, warmup=1, repeats=repeats)
        gflops = {name: flops_per_row * rows / us[name] / 1e3 for name in ("mkl", "panel fp32", "panel q4")}
        tiled = [us[name] / 1e3 if name in us else "-" for name in ("fp32 tiled", "q4 tiled")]
        table.append(
            [rows]
            + [us[name] / 1e3 for name in ("mkl", "panel fp32", "panel q4")]
            + list(gflops.values())
            + [us["mkl"] / us["panel fp32"], us["mkl"] / us["panel q4"]]
            + tiled
            + [q4_bytes / us["panel q4"] / 1e3, us["read q4"] / 1e3]
        )
    headers = ["rows", "mkl_ms", "panel_fp32_ms", "panel_q4_ms", "mkl_gflops", "fp32_gflops", "q4_gflops"]
    headers += ["fp32_speedup", "q4_speedup", "fp32_tiled_ms", "q4_tiled_ms", "q4_GBps", "read_q4_ms"]
    kernels_used = "AVX-512" if "avx512f" in cpu_flags().split() and not args.avx2 else "AVX2"
    print(
        f"{layers} layers x {len(LAYER_SHAPES)} projections + LM head {HEAD_SHAPE}, {args.threads} threads, "
        f"register kernels (<= {REGISTER_ROWS} rows): {kernels_used}"
    )
    print(format_table(headers, table))
    if args.formats is not None and args.format_rows:
        args.formats = args.formats or list(panel.FORMATS)
        print("\nEvery weight in one format: ms at each row count; GB/s at 1 row (the weights' bytes over the time)")
        print(format_table(*format_speeds(args, layers)))


def format_speeds(args: argparse.Namespace, layers: int) -> tuple[list[str], list[list[object]]]:
    """The step with every weight in each of ``args.formats``, the formats timed in interleaved rounds, each
    one's result checked bit for bit (first layer) against an fp32 panel of its decoded weights."""
    blocks = [gguf_blocks.TYPES[COMPACT_TYPES[fmt][0]].block_size for fmt in args.formats if fmt in panel.COMPACT]
    block = max([1, *blocks])  # every K rounded up to a multiple of it
    shapes = [(n, -(-k // block) * block) for n, k in LAYER_SHAPES * layers + [HEAD_SHAPE]]
    weights = {fmt: [format_coded(fmt, n, k) for n, k in shapes] for fmt in args.formats}
    x = torch.randn(3, shapes[0][1])
    for fmt, (first, *_) in weights.items():
        decoded = panel.pack_fp32(panel.rows(first, torch.arange(first.n)))
        if not torch.equal(panel_path(x, first, AUTO), panel_path(x, decoded, AUTO)):
            raise SystemExit(f"{fmt}: the panel does not compute with its decoded weights")
    ms = {fmt: [] for fmt in args.formats}
    for rows in args.format_rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        path = AVX2 if args.avx2 and rows <= REGISTER_ROWS else AUTO
        steps = {fmt: functools.partial(run_step, xs, ws, path) for fmt, ws in weights.items()}
        us = time_interleaved(steps, warmup=1, repeats=3 if args.quick or rows > 200 else 7)
        for fmt in args.formats:
            ms[fmt].append(us[fmt] / 1e3)
    num_weights = sum(n * k for n, k in shapes)
    table = []
    for fmt, ws in weights.items():
        nbytes = sum(p.nbytes for p in ws)
        gbps = nbytes / ms[fmt][args.format_rows.index(1)] / 1e6 if 1 in args.format_rows else "-"
        table.append([fmt, nbytes / num_weights, nbytes / 1e6, gbps] + ms[fmt])
    headers = ["format", "bytes_per_weight", "MB", "GBps_1_row"] + [f"ms_{rows}_rows" for rows in args.format_rows]
    return headers, table


def run_step(xs: dict[int, torch.Tensor], weights: list[panel.PanelWeight], path: int) -> list[torch.Tensor]:
    return [panel_path(xs[p.k], p, path) for p in weights]


if __name__ == "__main__":
    main()
