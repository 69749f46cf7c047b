"""Small helpers shared by the benchmark scripts: threads, timing, tables, JSON and plots.

Timing is meant for a noisy, shared 2-core machine: every candidate is warmed up, the candidates of one
configuration are timed in rounds, one call each in a shuffled order (so a burst of outside load, or the
after-effects of a multi-threaded op, hit all of them alike), and the median of many rounds is reported.
Compare numbers within one run only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

DEFAULT_THREADS = 2


def setup_threads(num_threads: int = DEFAULT_THREADS) -> None:
    """Pin torch to ``num_threads`` intra-op threads, the engine's setting on the target machine."""
    torch.set_num_threads(num_threads)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_us(fn: Callable[[], object], warmup: int = 5, repeats: int = 50, clock: str = "wall") -> float:
    """Median time of one ``fn()`` call in microseconds."""
    return time_interleaved({"fn": fn}, warmup=warmup, repeats=repeats, clock=clock)["fn"]


def time_interleaved(
    fns: dict[str, Callable[[], object]], warmup: int = 5, repeats: int = 50, clock: str = "wall"
) -> dict[str, float]:
    """Median microseconds per call of each ``fns`` entry (see ``sample_interleaved``)."""
    samples = sample_interleaved(fns, warmup, repeats, clock)
    return {name: statistics.median(values) for name, values in samples.items()}


def sample_interleaved(
    fns: dict[str, Callable[[], object]], warmup: int = 5, repeats: int = 50, clock: str = "wall"
) -> dict[str, list[float]]:
    """Every sample (microseconds, one call each) of each ``fns`` entry, taken in shuffled rounds.

    ``clock="cpu"`` reads the calling thread's CPU time: time spent descheduled by outside load does
    not count, which makes single-threaded runs on a busy machine comparable. It misses the work of
    other threads, so it is refused unless torch runs one intra-op thread.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if clock == "cpu" and torch.get_num_threads() != 1:
        raise ValueError("clock='cpu' counts only the calling thread: run with one intra-op thread (--threads 1)")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    now = CLOCKS[clock]
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order, rng = list(fns), random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)  # a fixed order would charge one candidate for its predecessor's after-effects
        for name in order:
            start = now()
            fns[name]()
            samples[name].append((now() - start) * 1e6)
    return samples


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], markdown: bool = False) -> str:
    """Right-aligned plain-text table, or a GitHub markdown table with ``markdown=True``."""
    cells = [[_cell(value) for value in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


def write_json(data: Any, path: str | Path) -> Path:
    """Write ``data`` as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def finish_report(
    rows: Sequence[Any], summary: dict, args: argparse.Namespace, text_out, plot: Callable[[], None]
) -> None:
    """The common end of a micro-benchmark: warn when outside load distorted the memory floor (its median far
    above its fastest sample), then the plot (``--plot``), ``--out-json`` and ``--json`` outputs."""
    disturbance = max(r.times_us["floor"] / r.min_us["floor"] for r in rows)
    if disturbance > 2:
        print(
            f"outside load: the floor's median reached {disturbance:.1f}x its fastest sample; "
            "compare within this run only, or see min_us in --json",
            file=text_out,
        )
    if args.plot:
        plot()
        print(f"plot: {args.plot}", file=text_out)
    if args.out_json:
        write_json(summary, args.out_json)
    if args.json:
        print(json.dumps(summary, indent=2))


def panels_by(
    rows: Sequence[Any], methods: Sequence[str], panel: Callable[[Any], str], x: Callable[[Any], float]
) -> dict[str, tuple[list[float], dict[str, list[float]]]]:
    """Group timed rows (each with ``times_us[method]``) into :func:`plot_lines` panels: one panel per
    ``panel(row)``, ``x(row)`` on the x axis, one series per method."""
    panels: dict[str, tuple[list[float], dict[str, list[float]]]] = {}
    for row in rows:
        xs, series = panels.setdefault(panel(row), ([], {m: [] for m in methods}))
        xs.append(x(row))
        for m in methods:
            series[m].append(row.times_us[m])
    return panels


def plot_lines(
    path: str | Path,
    panels: dict[str, tuple[Sequence[float], dict[str, Sequence[float]]]],
    xlabel: str,
    ylabel: str,
    title: str,
    log: bool = True,
    ncols: int = 2,
) -> Path:
    """One subplot per panel ``{title: (xs, {series: ys})}`` on a grid ``ncols`` wide, saved as a PNG.

    Uses the Agg backend, so it works on machines without a display.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ncols = max(1, min(ncols, len(panels)))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
    flat_axes = list(axes.flat)
    for ax in flat_axes[len(panels) :]:
        ax.set_visible(False)
    for ax, (panel_title, (xs, series)) in zip(flat_axes, panels.items(), strict=False):
        for label, ys in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        if log:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    flat_axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_output_args(parser: argparse.ArgumentParser, default_plot: str) -> None:
    """The flags every benchmark script shares: --quick, --json, --out-json, --plot, --threads, --clock."""
    parser.add_argument("--quick", action="store_true", help="a reduced set that finishes in seconds")
    parser.add_argument("--json", action="store_true", help="print a machine-readable summary to stdout")
    parser.add_argument("--out-json", default=None, help="also write the JSON summary to this path")
    parser.add_argument("--plot", default=default_plot, help="PNG path ('' to skip the plot)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or the thread's CPU time (needs --threads 1; ignores time lost to outside load)",
    )
