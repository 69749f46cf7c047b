"""Which GEMM layout is faster for the model's linear layers: ``x @ W^T`` (F.linear) or ``(W @ x^T)^T``?

    python benchmarks/linear_layout.py [--threads 2]

pagedkv's ``Linear`` picks the transposed form for batches of 8..512 rows, where MKL ran it 1.3-1.8x
faster on the 2-core AVX2 dev machine. Run this on a new machine before trusting that range.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, setup_threads, time_interleaved  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 32, 128, 512, 2048])
    args = parser.parse_args()
    setup_threads(args.threads)
    table = []
    for rows in args.rows:
        for name, (out_features, in_features) in SHAPES.items():
            if name == "lm_head" and rows > 128:
                continue
            w, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
            times = time_interleaved(
                {"linear": lambda w=w, x=x: F.linear(x, w), "transposed": lambda w=w, x=x: torch.mm(w, x.t()).t()},
                warmup=3,
                repeats=20,
            )
            table.append([rows, name, times["linear"], times["transposed"], times["linear"] / times["transposed"]])
    print(format_table(["rows", "layer", "F.linear us", "(W x^T)^T us", "speedup"], table))


if __name__ == "__main__":
    main()
