"""One mixture-of-experts layer: experts grouped per step (pagedkv's ``SparseMoeBlock``) vs the per-token loop.

    python benchmarks/moe_layer.py [--threads 2] [--experts 32] [--top-k 8] [--hidden 2048] [--width 768]

The grouped block sorts a step's (token, expert) assignments once and runs one GEMM per expert that has
tokens, so each expert's weights are read once a step; the loop (``moe.per_token_loop``) runs every token's
experts one by one, reading an expert once per token that chose it. Both run the engine's kernels (fp32
weights packed for the panel GEMM, the compiled SiLU-and-multiply) on the same block, alternating call by
call, and must give the same bits. The default expert shape is Qwen3-30B-A3B's (hidden 2048, expert width
768, top-8) with 32 experts instead of 128, so the layer's fp32 weights fit in 0.6 GB. The router picks
experts from random hidden states, so tokens spread over experts about evenly (a real model's may cluster).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import format_table, setup_threads, time_interleaved  # noqa: E402

from pagedkv import kernels  # noqa: E402
from pagedkv.model.layers import GatedMLP, Linear  # noqa: E402
from pagedkv.model.moe import SparseMoeBlock, per_token_loop  # noqa: E402
from pagedkv.model.moe_spec import MoESpec  # noqa: E402
from pagedkv.parallel.group import SINGLE  # noqa: E402


def packed_block(hidden: int, width: int, experts: int, top_k: int) -> SparseMoeBlock:
    """A random block whose linear layers are packed for the panel GEMM, as the engine's loader leaves them."""
    spec = MoESpec(experts, top_k, width, norm_topk_prob=True, sparse_layers=(True,))
    block = SparseMoeBlock(hidden, spec, torch.float32, SINGLE)
    generator = torch.Generator().manual_seed(0)
    for module in block.modules():
        if isinstance(module, Linear):
            module.weight.data.copy_(
                torch.randn(module.weight.shape, generator=generator) * module.weight.shape[1] ** -0.5
            )
            module.use_panel()
            module.release_weight()
        elif isinstance(module, GatedMLP):
            module.compiled = True
    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a small layer and 2 repeats: checks the script runs")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = parser.parse_args()
    if args.quick:
        args.experts, args.top_k, args.hidden, args.width, args.repeats = 8, 2, 128, 64, 2
    if not (kernels.portable.available() and kernels.gemm.available()):
        sys.exit("the compiled kernels (panel GEMM) do not build here: this benchmark measures the engine's path")
    setup_threads(args.threads)
    block = packed_block(args.hidden, args.width, args.experts, args.top_k)
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens))
            if not torch.equal(block(x), per_token_loop(block, x)):
                sys.exit(f"{tokens} tokens: the grouped block and the per-token loop differ")
            active = len(set(block.route(x)[0].flatten().tolist()))
            times = time_interleaved(
                {"grouped": lambda x=x: block(x), "loop": lambda x=x: per_token_loop(block, x)},
                warmup=2,
                repeats=args.repeats,
            )
            rows.append([tokens, active, tokens * args.top_k, times["grouped"], times["loop"]])
    if args.json:
        keys = ["tokens", "experts_read", "expert_calls_in_loop", "grouped_us", "loop_us"]
        print(json.dumps({"benchmark": "moe_layer", "quick": args.quick, "rows": [dict(zip(keys, r)) for r in rows]}))
        return
    table = [[*row, row[4] / row[3]] for row in rows]
    headers = ["tokens", "experts read", "loop expert calls", "grouped us", "loop us", "loop / grouped"]
    print(f"{args.experts} experts of {args.hidden}x{args.width}, top-{args.top_k}, {args.threads} threads")
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
