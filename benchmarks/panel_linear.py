"""All linear layers of one step of the default model: MKL (torch) against the panel GEMM, fp32 and exact codes.

    python benchmarks/panel_linear.py [--threads 2] [--rows 1 4 9 16 32 128 724] [--quick] [--avx2]

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

The weights are synthetic but coded like the GGUF file's, so ``pack`` accepts them as exact.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, setup_threads, time_interleaved  # noqa: E402

from pagedkv import kernels  # noqa: E402
from pagedkv.extension import cpu_flags  # noqa: E402
from pagedkv.model import panel  # noqa: E402
from pagedkv.model.codes import GROUP, Q4_LEVELS, Q8_LEVELS  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down of SmolLM2-135M
HEAD_SHAPE = (49152, 576)


def q4_coded(n: int, k: int) -> torch.Tensor:
    """``d * q + m`` with fp16 d, m and every group spanning q = 0..15, as llama.cpp's Q4_1 quantiser writes."""
    d = (torch.rand(n, k // GROUP) * 0.01).half().float()
    m = (-torch.rand(n, k // GROUP) * 0.08).half().float()
    q = torch.randint(0, Q4_LEVELS + 1, (n, k // GROUP, GROUP)).float()
    q[..., 0], q[..., -1] = 0, Q4_LEVELS
    return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(n, k)


def q8_coded(n: int, k: int) -> torch.Tensor:
    """``q * d`` with fp16 d and |q| reaching 127 in every group, as Q8_0 writes."""
    d = (torch.rand(n, k // GROUP) * 0.001 + 1e-4).half().float()
    q = torch.randint(-Q8_LEVELS, Q8_LEVELS + 1, (n, k // GROUP, GROUP)).float()
    q[..., 0] = Q8_LEVELS
    return (q * d.unsqueeze(-1)).reshape(n, k)


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
    args = parser.parse_args()
    setup_threads(args.threads)
    if not kernels.gemm.available():
        raise SystemExit("the panel kernel could not be built; see the warning above")
    layers = 4 if args.quick else args.layers
    weights = [q4_coded(n, k) for _ in range(layers) for n, k in LAYER_SHAPES] + [q8_coded(*HEAD_SHAPE)]
    fp32 = [panel.pack(w, "fp32") for w in weights]
    coded = [panel.pack(w, "q4") for w in weights[:-1]] + [panel.pack(weights[-1], "q8")]
    if any(p is None for p in coded):
        raise SystemExit("a synthetic weight was not packed exactly")
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


if __name__ == "__main__":
    main()
