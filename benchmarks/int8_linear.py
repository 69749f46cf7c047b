"""One linear layer, exact panel GEMM ("gguf") against the int8-activation GEMM ("gguf-int8"), per type.

"tiled" is the kernel on the repacked groups of 16 outputs that "gguf-int8" loads every type of
``int8_linear.REPACKED`` as.

    python benchmarks/int8_linear.py [--threads 1] [--rounds 3] [--types Q8_0,Q5_0]

TinyLlama-1.1B's MLP shapes (5632 x 2048, and 2048 x 5632 for the down projection) of random blocks, at 1 row
(a decode step) and 32 rows (32 requests decoding together). The two are timed alternately, in CPU time of this
process (``time.process_time``: on a shared machine the wall clock counts the other tenants too), best of
``--rounds``; microseconds a call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from pagedkv.model import gguf_blocks, int8_linear, panel  # noqa: E402

# where each block's fp16 scales sit
HALVES_AT = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}
SHAPES = [(T.Q4_K, 5632, 2048), (T.Q6_K, 2048, 5632)] + [(t, 5632, 2048) for t in (T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1)]


def random_blocks(ggml_type: T, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in HALVES_AT[ggml_type]:
        halves = rng.normal(0, 1e-2, size=(n, k // block)).astype(np.float16)
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def cpu_us(call, repeats: int) -> float:
    call()
    start = time.process_time()
    for _ in range(repeats):
        call()
    return (time.process_time() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--types", default="", help="comma-separated ggml type names (default: all)")
    args = parser.parse_args()
    wanted = {name.strip().upper() for name in args.types.split(",") if name.strip()}
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"{'type':6}{'N x K':>13}{'rows':>6}{'exact us':>11}{'tiled us':>10}{'exact/tiled':>13}")
    for ggml_type, n, k in SHAPES:
        if wanted and ggml_type.name not in wanted:
            continue
        raw = random_blocks(ggml_type, n, k, rng)
        weights = {
            "exact": gguf_blocks.pack(raw, int(ggml_type), n, k),
            "tiled": int8_linear.repack(raw, n, k, ggml_type),
        }
        for rows in (1, 32):
            x = torch.randn(rows, k)
            repeats = 20 if rows == 1 else 5
            times = {name: [] for name in weights}
            for _ in range(args.rounds):  # alternately, so that a noisy neighbour hits each alike
                for name, w in weights.items():
                    times[name].append(cpu_us(lambda x=x, w=w: panel.panel_linear(x, w), repeats))
            best = {name: min(values) for name, values in times.items()}
            print(
                f"{ggml_type.name:6}{f'{n} x {k}':>13}{rows:>6}{best['exact']:>11.0f}{best['tiled']:>10.0f}"
                f"{best['exact'] / best['tiled']:>13.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
