"""Decode attention over the paged KV pool: the compiled kernel against gather + SDPA and the memory floor.

For each model shape, batch size and context length (block_size 16, shuffled block tables) one decode
step's attention -- one query per request over its whole context -- is computed by

- ``kernel``  ``decode_attention_kernel``: C++ over the block table, K/V read in place (no copy)
- ``gather``  ``decode_attention_reference``: one ``index_select`` of every context, then SDPA per request
- ``floor``   the memory floor: the bytes of K/V the step must read / memcpy bandwidth. The bandwidth is
              measured in every row, interleaved with the candidates, by copying a 64 MiB tensor into a
              preallocated one (``clone()`` would also pay first-touch page faults for its fresh output).

Both candidates are checked to agree before they are timed.
Run: ``python benchmarks/attention.py`` (``--quick`` for a few seconds, ``--json`` for machine output).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
from common import (
    add_output_args,
    finish_report,
    format_table,
    panels_by,
    plot_lines,
    sample_interleaved,
    setup_threads,
)

from pagedkv.attention.kernel import decode_attention_kernel, decode_attention_reference, kernel_available

BLOCK_SIZE = 16
BATCHES = (1, 8, 32)
CONTEXTS = (128, 1024, 4096)
SHAPES = ((3, 9, 64), (8, 32, 128))  # (num_kv_heads, num_q_heads, head_dim): SmolLM2-135M, a Llama-8B-like
METHODS = ("kernel", "gather", "floor")
COPY_BYTES = 64 << 20
ROW_BUDGET_S = 1.5  # time spent sampling one row, split over its repeats
ACCEPT_BATCH, ACCEPT_CONTEXT, ACCEPT_SPEEDUP, ACCEPT_VS_FLOOR, PARITY_CONTEXT = 8, 4096, 1.5, 2.0, 1024


@dataclass(slots=True)
class Row:
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    dtype: str
    batch: int
    context: int
    bytes: int  # K and V the step reads
    times_us: dict[str, float]  # medians
    min_us: dict[str, float]  # fastest samples: the cost without outside load
    memcpy_gbps: float
    gather_over_kernel: float
    kernel_over_floor: float


def make_step(kv_heads: int, q_heads: int, dim: int, dtype: torch.dtype, batch: int, context: int, seed: int):
    """Pools holding exactly the step's blocks, each request's table a random slice of a shuffle of them."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_request
    k_pool = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_request)
    q = torch.randn(batch, q_heads, dim, generator=gen).to(dtype)
    return q, k_pool, v_pool, tables, torch.full((batch,), context, dtype=torch.int64)


def time_row(
    kv_heads: int, q_heads: int, dim: int, dtype: torch.dtype, batch: int, context: int, repeats: int | None
) -> Row:
    q, k_pool, v_pool, tables, seq_lens = make_step(kv_heads, q_heads, dim, dtype, batch, context, seed=batch)
    scale = dim**-0.5
    src = torch.randn(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    fns = {
        "kernel": lambda: decode_attention_kernel(q, k_pool, v_pool, tables, seq_lens, scale),
        "gather": lambda: decode_attention_reference(q, k_pool, v_pool, tables, seq_lens, scale),
        "memcpy": lambda: dst.copy_(src),
    }
    expected, got = fns["gather"]().float(), fns["kernel"]().float()
    if not torch.allclose(got, expected, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=0):
        raise RuntimeError(f"kernel and gather disagree by {float((got - expected).abs().max()):.2e}")
    if repeats is None:
        once = sum(min(sample_interleaved(fns, warmup=1, repeats=2)[name]) for name in fns) / 1e6
        repeats = max(5, min(40, int(ROW_BUDGET_S / once)))
    samples = sample_interleaved(fns, warmup=2, repeats=repeats)
    times = {name: statistics.median(values) for name, values in samples.items()}
    mins = {name: min(values) for name, values in samples.items()}
    kv_bytes = 2 * batch * context * kv_heads * dim * k_pool.element_size()
    gbps = COPY_BYTES / times.pop("memcpy") / 1e3
    times["floor"] = kv_bytes / gbps / 1e3
    mins["floor"] = kv_bytes / (COPY_BYTES / mins.pop("memcpy") / 1e3) / 1e3
    return Row(
        num_kv_heads=kv_heads,
        num_q_heads=q_heads,
        head_dim=dim,
        dtype=str(dtype).removeprefix("torch."),
        batch=batch,
        context=context,
        bytes=kv_bytes,
        times_us=times,
        min_us=mins,
        memcpy_gbps=gbps,
        gather_over_kernel=times["gather"] / times["kernel"],
        kernel_over_floor=times["kernel"] / times["floor"],
    )


def run(shapes, dtypes, batches, contexts, repeats: int | None) -> list[Row]:
    return [
        time_row(kv_heads, q_heads, dim, dtype, batch, context, repeats)
        for kv_heads, q_heads, dim in shapes
        for dtype in dtypes
        for batch in batches
        for context in contexts
    ]


def table_text(rows: list[Row], markdown: bool = False) -> str:
    headers = [
        "Hkv/Hq x D",
        "dtype",
        "batch",
        "context",
        "MiB",
        *(f"{m} us" for m in METHODS),
        "gather/kernel",
        "kernel/floor",
    ]
    body = [
        [
            f"{r.num_kv_heads}/{r.num_q_heads}x{r.head_dim}",
            r.dtype,
            r.batch,
            r.context,
            r.bytes / 2**20,
            *(r.times_us[m] for m in METHODS),
            r.gather_over_kernel,
            r.kernel_over_floor,
        ]
        for r in rows
    ]
    return format_table(headers, body, markdown=markdown)


def acceptance(rows: list[Row]) -> list[dict[str, object]]:
    """Per shape, fp32: at batch 8 x 4096 the kernel is >= 1.5x gather and <= 2x the floor; at 1024 it is
    never slower than gather."""
    out = []
    for shape in dict.fromkeys((r.num_kv_heads, r.num_q_heads, r.head_dim) for r in rows):
        mine = [r for r in rows if (r.num_kv_heads, r.num_q_heads, r.head_dim) == shape and r.dtype == "float32"]
        main = [r for r in mine if r.batch == ACCEPT_BATCH and r.context == ACCEPT_CONTEXT]
        parity = [r.gather_over_kernel for r in mine if r.context == PARITY_CONTEXT]
        if not main:
            continue
        (r,) = main
        worst_parity = min(parity, default=math.inf)
        out.append(
            {
                "num_kv_heads": shape[0],
                "num_q_heads": shape[1],
                "head_dim": shape[2],
                "gather_over_kernel": r.gather_over_kernel,
                "kernel_over_floor": r.kernel_over_floor,
                "worst_gather_over_kernel_at_1024": worst_parity,
                "met": r.gather_over_kernel >= ACCEPT_SPEEDUP
                and r.kernel_over_floor <= ACCEPT_VS_FLOOR
                and worst_parity >= 1.0,
            }
        )
    return out


def plot(rows: list[Row], path: str) -> None:
    plot_lines(
        path,
        panels_by(
            rows,
            METHODS,
            lambda r: f"Hkv {r.num_kv_heads}, Hq {r.num_q_heads}, D {r.head_dim}, {r.dtype}, batch {r.batch}",
            lambda r: r.context,
        ),
        "context (tokens)",
        "µs per step (median)",
        f"Paged decode attention, one layer (block_size {BLOCK_SIZE}, {torch.get_num_threads()} threads)",
        ncols=3,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, default_plot="benchmarks/results/attention.png")
    parser.add_argument("--repeats", type=int, default=None, help="samples per candidate (default: adaptive)")
    parser.add_argument("--bf16", action="store_true", help="also time bfloat16 pools")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    if not kernel_available():
        print(
            "the C++ decode kernel could not be built (see the warning above): nothing to compare",
            file=sys.stderr,
        )
        return 1
    dtypes = (torch.float32, torch.bfloat16) if args.bf16 else (torch.float32,)
    if args.quick:
        rows = run(SHAPES[:1], dtypes, (ACCEPT_BATCH,), (PARITY_CONTEXT, ACCEPT_CONTEXT), args.repeats or 5)
    else:
        rows = run(SHAPES, dtypes, BATCHES, CONTEXTS, args.repeats)
    summary = {
        "benchmark": "attention",
        "unit": "us",
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "block_size": BLOCK_SIZE,
        "torch": torch.__version__,
        "methods": list(METHODS),
        "rows": [asdict(r) for r in rows],
        "acceptance": acceptance(rows),
    }
    text_out = sys.stderr if args.json else sys.stdout
    print(table_text(rows, markdown=args.markdown), file=text_out)
    for a in summary["acceptance"]:
        print(
            f"fp32 {a['num_kv_heads']}/{a['num_q_heads']}x{a['head_dim']}, "
            f"batch {ACCEPT_BATCH} x {ACCEPT_CONTEXT}: "
            f"gather/kernel {a['gather_over_kernel']:.2f}x (target >= {ACCEPT_SPEEDUP}), kernel/floor "
            f"{a['kernel_over_floor']:.2f}x (target <= {ACCEPT_VS_FLOOR}); worst gather/kernel at "
            f"{PARITY_CONTEXT}: {a['worst_gather_over_kernel_at_1024']:.2f}x (target >= 1): "
            f"{'met' if a['met'] else 'NOT met'}",
            file=text_out,
        )
    finish_report(rows, summary, args, text_out, lambda: plot(rows, args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
