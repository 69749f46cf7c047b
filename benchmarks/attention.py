"""Attention over the paged KV pool: the engine's two attention backends and the memory floor.

For each model shape (block_size 16, shuffled block tables) one layer of a step runs through a backend's
``forward``, the call every layer makes (K/V write included); the step's metadata is built once outside the
timing, as the engine builds it once for all layers. Two kinds of step:

- decode: ``batch`` requests, one new query each over its whole ``context``, for several batches and contexts
- prefill: one prompt of ``context`` tokens as one chunk, every token a causal query

and four columns:

- ``kernel``  ``KernelAttention``: the compiled kernel, every row of the step in one call, K/V read in place
- ``kernel_fp16``  the same on fp16 pools (``kv_cache_dtype="float16"``): half the bytes, widened as read
- ``gather``  ``TorchAttention``: one ``index_select`` of every context, then SDPA per request
- ``floor``   the memory floor: the bytes of fp32 K/V the step must read / memcpy bandwidth. The bandwidth is
              measured in every row, interleaved with the candidates, by copying a 64 MiB tensor into a
              preallocated one (``clone()`` would also pay first-touch page faults for its fresh output).
              A prefill is compute-bound: its floor is far below either backend.

The fp32 candidates are checked to agree before they are timed, and the fp16 one to stay within fp16's rounding.
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

from pagedkv import kernels
from pagedkv.attention.paged import KernelAttention, TorchAttention
from pagedkv.kv import ops

BLOCK_SIZE = 16
BATCHES = (1, 8, 32)
CONTEXTS = (128, 1024, 4096)
PREFILLS = (512, 2048)  # prompt lengths, one request, the whole prompt in one chunk
SHAPES = ((3, 9, 64), (8, 32, 128))  # (num_kv_heads, num_q_heads, head_dim): SmolLM2-135M, a Llama-8B-like
METHODS = ("kernel", "kernel_fp16", "gather", "floor")
COPY_BYTES = 64 << 20
ROW_BUDGET_S = 1.5  # time spent sampling one row, split over its repeats
ACCEPT_BATCH, ACCEPT_CONTEXT, ACCEPT_SPEEDUP, ACCEPT_VS_FLOOR, PARITY_CONTEXT = 8, 4096, 1.5, 2.0, 1024


@dataclass(slots=True)
class Row:
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    kind: str  # "decode" (one query per request) or "prefill" (one request, ``context`` queries)
    batch: int
    context: int
    bytes: int  # K and V the step reads
    times_us: dict[str, float]  # medians
    min_us: dict[str, float]  # fastest samples: the cost without outside load
    memcpy_gbps: float
    gather_over_kernel: float
    kernel_over_floor: float
    kernel_over_fp16: float  # what an fp16 pool gains (decodes read half the bytes)


def make_step(kv_heads: int, q_heads: int, dim: int, batch: int, context: int, queries: int, seed: int):
    """Pools holding exactly the step's blocks, each request's table a random slice of a shuffle of them, and
    ``queries`` new rows per request; the new K/V are the pool's rows at those positions (writing them changes
    nothing)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_request
    k_pool = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen)
    v_pool = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_request).tolist()
    q = torch.randn(batch * queries, q_heads, dim, generator=gen)
    return q, k_pool, v_pool, tables


def layer(backend, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list, context: int):
    """One layer's call of ``backend`` in the step, its metadata built once (as the engine does per step)."""
    batch, dim = len(tables), q.shape[-1]
    meta = backend.build_metadata(tables, [q.shape[0] // batch] * batch, [context] * batch, BLOCK_SIZE)
    k, v = (ops.gather_slots(pool, meta.slot_mapping).float() for pool in (k_pool, v_pool))  # fp32, as layers make
    return lambda: backend.forward(q, k, v, k_pool, v_pool, meta, dim**-0.5)


def time_row(kind: str, kv_heads: int, q_heads: int, dim: int, batch: int, context: int, repeats: int | None) -> Row:
    queries = 1 if kind == "decode" else context
    q, k_pool, v_pool, tables = make_step(kv_heads, q_heads, dim, batch, context, queries, seed=batch)
    src = torch.randn(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    fns = {
        "kernel": layer(KernelAttention(), q, k_pool, v_pool, tables, context),
        "kernel_fp16": layer(KernelAttention(), q, k_pool.half(), v_pool.half(), tables, context),
        "gather": layer(TorchAttention(), q, k_pool, v_pool, tables, context),
        "memcpy": lambda: dst.copy_(src),
    }
    expected, got = fns["gather"](), fns["kernel"]()
    if not torch.allclose(got, expected, atol=1e-4, rtol=0):
        raise RuntimeError(f"kernel and gather disagree by {float((got - expected).abs().max()):.2e}")
    if not torch.allclose(fns["kernel_fp16"](), got, atol=1e-2, rtol=0):
        raise RuntimeError("the kernel on fp16 pools is further from fp32 than fp16's rounding")
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
        kind=kind,
        batch=batch,
        context=context,
        bytes=kv_bytes,
        times_us=times,
        min_us=mins,
        memcpy_gbps=gbps,
        gather_over_kernel=times["gather"] / times["kernel"],
        kernel_over_floor=times["kernel"] / times["floor"],
        kernel_over_fp16=times["kernel"] / times["kernel_fp16"],
    )


def run(shapes, batches, contexts, prefills, repeats: int | None) -> list[Row]:
    rows = []
    for kv_heads, q_heads, dim in shapes:
        rows += [
            time_row("decode", kv_heads, q_heads, dim, batch, context, repeats)
            for batch in batches
            for context in contexts
        ]
        rows += [time_row("prefill", kv_heads, q_heads, dim, 1, context, repeats) for context in prefills]
    return rows


def table_text(rows: list[Row], markdown: bool = False) -> str:
    headers = [
        "Hkv/Hq x D",
        "step",
        "batch",
        "context",
        "MiB",
        *(f"{m} us" for m in METHODS),
        "gather/kernel",
        "kernel/floor",
        "kernel/fp16",
    ]
    body = [
        [
            f"{r.num_kv_heads}/{r.num_q_heads}x{r.head_dim}",
            r.kind,
            r.batch,
            r.context,
            r.bytes / 2**20,
            *(r.times_us[m] for m in METHODS),
            r.gather_over_kernel,
            r.kernel_over_floor,
            r.kernel_over_fp16,
        ]
        for r in rows
    ]
    return format_table(headers, body, markdown=markdown)


def acceptance(rows: list[Row]) -> list[dict[str, object]]:
    """Per shape, decode steps: at batch 8 x 4096 the kernel is >= 1.5x gather and <= 2x the floor; at 1024
    it is never slower than gather."""
    out = []
    for shape in dict.fromkeys((r.num_kv_heads, r.num_q_heads, r.head_dim) for r in rows):
        mine = [r for r in rows if (r.num_kv_heads, r.num_q_heads, r.head_dim) == shape and r.kind == "decode"]
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


def _step_name(r: Row) -> str:
    return f"decode, batch {r.batch}" if r.kind == "decode" else "prefill of one prompt"


def plot(rows: list[Row], path: str) -> None:
    plot_lines(
        path,
        panels_by(
            rows,
            METHODS,
            lambda r: f"Hkv {r.num_kv_heads}, Hq {r.num_q_heads}, D {r.head_dim}, {_step_name(r)}",
            lambda r: r.context,
        ),
        "context (tokens)",
        "µs per step (median)",
        f"Paged attention, one layer (block_size {BLOCK_SIZE}, {torch.get_num_threads()} threads)",
        ncols=3,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, default_plot="benchmarks/results/attention.png")
    parser.add_argument("--repeats", type=int, default=None, help="samples per candidate (default: adaptive)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    if not kernels.portable.available():
        print(
            "the C++ attention kernel could not be built (see the warning above): nothing to compare",
            file=sys.stderr,
        )
        return 1
    if args.quick:
        rows = run(SHAPES[:1], (ACCEPT_BATCH,), (PARITY_CONTEXT, ACCEPT_CONTEXT), PREFILLS[:1], args.repeats or 5)
    else:
        rows = run(SHAPES, BATCHES, CONTEXTS, PREFILLS, args.repeats)
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
            f"{a['num_kv_heads']}/{a['num_q_heads']}x{a['head_dim']}, "
            f"batch {ACCEPT_BATCH} x {ACCEPT_CONTEXT}: "
            f"gather/kernel {a['gather_over_kernel']:.2f}x (target >= {ACCEPT_SPEEDUP}), kernel/floor "
            f"{a['kernel_over_floor']:.2f}x (target <= {ACCEPT_VS_FLOOR}); worst gather/kernel at "
            f"{PARITY_CONTEXT}: {a['worst_gather_over_kernel_at_1024']:.2f}x (target >= 1): "
            f"{'met' if a['met'] else 'NOT met'}",
            file=text_out,
        )
    for r in rows:
        if r.kind == "prefill":
            print(
                f"{r.num_kv_heads}/{r.num_q_heads}x{r.head_dim}, prefill of {r.context} tokens: "
                f"kernel {r.times_us['kernel'] / 1e3:.1f} ms, gather {r.times_us['gather'] / 1e3:.1f} ms "
                f"(gather/kernel {r.gather_over_kernel:.2f}x)",
                file=text_out,
            )
    finish_report(rows, summary, args, text_out, lambda: plot(rows, args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
