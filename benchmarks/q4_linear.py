"""Decode-size GEMMs: fp32 weights (F.linear, ``(W x^T)^T``) against 4-bit Q4 weights (``q4_linear``).

    python benchmarks/q4_linear.py [--threads 2] [--rows 1 4 8 16 32] [--quick]

At 1-32 rows a linear layer is bound by the bytes of W it reads: fp32 is 4 bytes a weight, the Q4 codes
plus fp32 (d, m) per 32 weights are 0.75. The weights are synthetic Q4_1 groups (every group holds q = 0
and q = 15, as llama.cpp's quantiser produces), so ``encode`` is exact; every q4 result is checked against
F.linear before it is timed. ``lm_head`` is Q8_0 in the default GGUF (only the 210 per-layer projections
are Q4_1), so its row shows what a Q4 head would give, not what the default model can use.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, setup_threads, time_interleaved  # noqa: E402

from pagedkv.model.q4 import GROUP, LEVELS, Q4Weight, encode, kernel_available, q4_linear  # noqa: E402

COLD_BYTES = 96 << 20  # more fp32 weight copies than the last-level cache holds, as in a real decode step
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def q4_style_weight(n: int, k: int) -> torch.Tensor:
    """``d * q + m`` from fp16 d, m and 4-bit q, each group spanning q = 0..15 like a real Q4_1 group."""
    d = (torch.rand(n, k // GROUP) * 0.01).half().float()
    m = (-torch.rand(n, k // GROUP) * 0.08).half().float()
    q = torch.randint(0, LEVELS + 1, (n, k // GROUP, GROUP)).float()
    q[..., 0], q[..., -1] = 0, LEVELS
    return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(n, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    parser.add_argument("--quick", action="store_true", help="few repeats, no lm_head")
    parser.add_argument("--hot", action="store_true", help="reuse one weight copy (cache-resident) per shape")
    args = parser.parse_args()
    setup_threads(args.threads)
    if not kernel_available():
        raise SystemExit("the Q4 kernel could not be built; see the warning above")
    repeats = 5 if args.quick else 30
    table = []
    for name, (n, k) in SHAPES.items():
        if args.quick and name == "lm_head":
            continue
        w = q4_style_weight(n, k)
        packed = encode(w)
        if packed is None:
            raise SystemExit(f"encode was not exact on the synthetic {name} weight")
        count = 1 if args.hot else math.ceil(COLD_BYTES / w.nbytes)
        copies = [w] + [w.clone() for _ in range(count - 1)]
        q4_copies = [packed] + [
            Q4Weight(*(t.clone() for t in (packed.qweight, packed.d, packed.m))) for _ in copies[1:]
        ]
        for rows in args.rows:
            x = torch.randn(rows, k)
            reference = F.linear(x, w)
            error = (q4_linear(x, packed) - reference).abs().max().item()
            if error > 1e-4 * reference.abs().max().item():
                raise SystemExit(f"q4_linear is off by {error:.3g} on {name} with {rows} rows")
            ws, qs = itertools.cycle(copies), itertools.cycle(q4_copies)
            times = time_interleaved(
                {
                    "linear": lambda ws=ws, x=x: F.linear(x, next(ws)),
                    "transposed": lambda ws=ws, x=x: torch.mm(next(ws), x.t()).t(),
                    "q4": lambda qs=qs, x=x: q4_linear(x, next(qs)),
                },
                warmup=3,
                repeats=repeats,
            )
            best = min(times["linear"], times["transposed"])
            table.append([name, rows, times["linear"], times["transposed"], times["q4"], best / times["q4"]])
    headers = ["layer", "rows", "F.linear us", "(W x^T)^T us", "q4 us", "q4 speedup vs best fp32"]
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
