"""Reading one request's K/V from the paged pool: the tutorial's three versions against the engine's.

For each pool shape, dtype and context length the same shuffled block table is read by

- ``loop``        tutorial v1: Python loop over blocks + ``torch.cat`` (``reference.gather_kv_loop``)
- ``indexed``     tutorial v2: ``pool[blocks, offsets]`` (``reference.gather_kv_indexed``)
- ``gather_kv``   tutorial v3: one ``index_select`` on the block dimension (``reference.gather_kv``), from the
                  Python block table, index conversion and checks included, as one call
- ``slots+sel``   flat per-token route: ``ops.slot_mapping`` then ``ops.gather_slots`` (slot math included)
- ``slots_out``   what the engine does per layer: ``ops.gather_slots`` with precomputed slots into ``out=``
- ``floor``       memory floor: ``clone()`` of a contiguous tensor holding the same bytes

Every candidate is checked to return the same tensor before it is timed.
Run: ``python benchmarks/gather.py`` (``--quick`` for a few seconds, ``--json`` for machine output).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable, Sequence
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

from pagedkv.kv import ops, reference

BLOCK_SIZE = 16
SEQ_LENS = (16, 64, 256, 1024, 4096, 8192)
SHAPES = ((3, 64), (8, 128))  # (num_kv_heads, head_dim): SmolLM2-135M, and a wider model
DTYPES = (torch.float32, torch.bfloat16)
METHODS = ("loop", "indexed", "gather_kv", "slots+sel", "slots_out", "floor")
ACCEPT_SEQ_LEN, ACCEPT_VS_LOOP, ACCEPT_VS_FLOOR = 4096, 3.0, 1.5


@dataclass(slots=True)
class Row:
    num_kv_heads: int
    head_dim: int
    dtype: str
    seq_len: int
    bytes: int
    times_us: dict[str, float]  # medians
    min_us: dict[str, float]  # fastest samples: what the call costs without outside load
    loop_over_ours: float
    ours_over_floor: float


def make_pool(heads: int, head_dim: int, dtype: torch.dtype, max_seq_len: int) -> torch.Tensor:
    """A pool with room for the longest context plus slack, so the table is a sparse shuffle of it."""
    num_blocks = max(2048, 2 * -(-max_seq_len // BLOCK_SIZE))
    return torch.randn(num_blocks, BLOCK_SIZE, heads, head_dim).to(dtype)


def candidates(pool: torch.Tensor, table: list[int], seq_len: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The six readers of positions ``[0, seq_len)``, as zero-argument callables."""
    slots = ops.slot_mapping(table, 0, seq_len, BLOCK_SIZE)
    out = torch.empty(seq_len, pool.shape[2], pool.shape[3], dtype=pool.dtype)
    same_bytes = torch.randn(seq_len, pool.shape[2], pool.shape[3]).to(pool.dtype)
    return {
        "loop": lambda: reference.gather_kv_loop(pool, table, seq_len, BLOCK_SIZE),
        "indexed": lambda: reference.gather_kv_indexed(pool, table, seq_len, BLOCK_SIZE),
        "gather_kv": lambda: reference.gather_kv(pool, table, seq_len, BLOCK_SIZE),
        "slots+sel": lambda: ops.gather_slots(pool, ops.slot_mapping(table, 0, seq_len, BLOCK_SIZE)),
        "slots_out": lambda: ops.gather_slots(pool, slots, out=out),
        "floor": same_bytes.clone,
    }


def check_same(fns: dict[str, Callable[[], torch.Tensor]]) -> None:
    expected = fns["loop"]()
    for name in METHODS[1:-1]:
        if not torch.equal(fns[name](), expected):
            raise RuntimeError(f"{name} returned a different tensor than the loop: the benchmark is invalid")


def run(
    seq_lens: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    dtypes: Sequence[torch.dtype],
    repeats: int,
    clock: str = "wall",
    seed: int = 0,
) -> list[Row]:
    """Time every candidate on every configuration; long contexts get a third of the repeats."""
    rows = []
    rng = random.Random(seed)
    for heads, head_dim in shapes:
        for dtype in dtypes:
            pool = make_pool(heads, head_dim, dtype, max(seq_lens))
            table = rng.sample(range(pool.shape[0]), -(-max(seq_lens) // BLOCK_SIZE))
            for seq_len in seq_lens:
                fns = candidates(pool, table, seq_len)
                check_same(fns)
                n = repeats if seq_len <= 1024 else max(5, repeats // 3)
                samples = sample_interleaved(fns, warmup=3, repeats=n, clock=clock)
                times = {name: statistics.median(values) for name, values in samples.items()}
                rows.append(
                    Row(
                        num_kv_heads=heads,
                        head_dim=head_dim,
                        dtype=str(dtype).removeprefix("torch."),
                        seq_len=seq_len,
                        bytes=seq_len * heads * head_dim * pool.element_size(),
                        times_us=times,
                        min_us={name: min(values) for name, values in samples.items()},
                        loop_over_ours=times["loop"] / times["gather_kv"],
                        ours_over_floor=times["gather_kv"] / times["floor"],
                    )
                )
    return rows


def table_text(rows: list[Row], markdown: bool = False) -> str:
    headers = ["H x D", "dtype", "seq_len", "KiB", *METHODS, "loop/ours", "ours/floor"]
    body = [
        [
            f"{r.num_kv_heads}x{r.head_dim}",
            r.dtype,
            r.seq_len,
            r.bytes // 1024,
            *(r.times_us[m] for m in METHODS),
            r.loop_over_ours,
            r.ours_over_floor,
        ]
        for r in rows
    ]
    return format_table(headers, body, markdown=markdown)


def acceptance(rows: list[Row]) -> list[dict[str, object]]:
    """The target: at seq_len 4096 fp32, gather_kv >= 3x faster than the loop and within 1.5x of floor."""
    return [
        {
            "num_kv_heads": r.num_kv_heads,
            "head_dim": r.head_dim,
            "loop_over_ours": r.loop_over_ours,
            "ours_over_floor": r.ours_over_floor,
            "met": r.loop_over_ours >= ACCEPT_VS_LOOP and r.ours_over_floor <= ACCEPT_VS_FLOOR,
        }
        for r in rows
        if r.seq_len == ACCEPT_SEQ_LEN and r.dtype == "float32"
    ]


def plot(rows: list[Row], path: str, clock: str) -> None:
    plot_lines(
        path,
        panels_by(rows, METHODS, lambda r: f"{r.num_kv_heads} heads x {r.head_dim}, {r.dtype}", lambda r: r.seq_len),
        "seq_len (tokens)",
        f"µs per call (median, {clock} clock)",
        f"Gathering one request's K/V from the pool (block_size {BLOCK_SIZE}, {torch.get_num_threads()} threads)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, default_plot="benchmarks/results/gather.png")
    parser.add_argument("--repeats", type=int, default=None, help="samples per candidate (60, quick: 10)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    if args.quick:
        rows = run((16, ACCEPT_SEQ_LEN), SHAPES[:1], DTYPES[:1], args.repeats or 10, args.clock)
    else:
        rows = run(SEQ_LENS, SHAPES, DTYPES, args.repeats or 60, args.clock)
    summary = {
        "benchmark": "gather",
        "unit": "us",
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "block_size": BLOCK_SIZE,
        "torch": torch.__version__,
        "methods": list(METHODS),
        "rows": [asdict(r) for r in rows],
        "acceptance": acceptance(rows),
    }
    text_out = sys.stderr if args.json else sys.stdout
    print(table_text(rows, markdown=args.markdown), file=text_out)
    for a in summary["acceptance"]:
        verdict = "met" if a["met"] else "NOT met"
        print(
            f"seq_len {ACCEPT_SEQ_LEN} fp32 {a['num_kv_heads']}x{a['head_dim']}: "
            f"loop/ours {a['loop_over_ours']:.1f}x (target >= {ACCEPT_VS_LOOP}), "
            f"ours/floor {a['ours_over_floor']:.2f}x (target <= {ACCEPT_VS_FLOOR}): {verdict}",
            file=text_out,
        )
    finish_report(rows, summary, args, text_out, lambda: plot(rows, args.plot, args.clock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
