"""The KV map as a PNG: the same picture as the server's ``GET /kv`` page, from its JSON.

``pagedkv kv-map --server URL --output FILE.png`` fetches ``/kv.json`` from a running server;
``LLM.save_kv_map(path)`` draws an offline engine's. Both go through ``render_kv_map``: the blocks as a grid
of squares in block-id order (coloured by state, cached ones shaded by eviction order), the hottest cached
prefixes as a tree, and the counters over time. The grid is drawn pixel for pixel (``figimage``), never
resampled, so every block is a crisp square whatever the pool size. A model with sliding-window layers gets a
second grid under the first: their own block group's blocks (``window_group`` in the JSON), in the same colours.

matplotlib is an optional dependency (``pip install 'pagedkv[plot]'``); nothing else in pagedkv needs it.
"""

from __future__ import annotations

import json
import math
import os
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.kv.snapshot import CACHED, STATES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH_PX, DPI, MARGIN_PX = 1200, 100, 24
TITLE_PX, LEGEND_PX, PANEL_PX = 44, 34, 380
WINDOW_TITLE_PX = 28  # the caption above the sliding-window group's grid
MAX_TREE_LINES = 24


def fetch_kv_json(server: str, api_key: str | None = None, timeout_s: float = 30.0) -> dict:
    """GET ``{server}/kv.json`` (with the API key as a Bearer token when given)."""
    request = urllib.request.Request(server.rstrip("/") + "/kv.json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (a URL the user gave)
        return json.load(response)


def cell_size(num_blocks: int) -> int:
    """Pixels per block square (a 1-pixel gap follows): big pools get smaller squares, like the page's."""
    return 10 if num_blocks <= 2048 else 6 if num_blocks <= 8192 else 3


def block_colours(data: dict) -> np.ndarray:
    """[num_blocks, 3] uint8 RGB, one per block, as the page colours them."""
    rgb = {name: _rgb(value) for name, value in data["palette"].items()}
    n_cached = max(data.get("num_cached_free", 0), 1)
    out = np.empty((data["num_blocks"], 3), dtype=np.uint8)
    for block in data["blocks"]:
        if block["state"] == CACHED:
            t = block["eviction_rank"] / (n_cached - 1) if n_cached > 1 else 1.0
            out[block["id"]] = np.round(rgb["cached_next"] + (rgb["cached_last"] - rgb["cached_next"]) * t)
        else:
            out[block["id"]] = rgb[block["state"]]
    return out


def grid_image(data: dict, width_px: int) -> np.ndarray:
    """The blocks as squares on white, row-major in block-id order, ``width_px`` wide at most."""
    n = data["num_blocks"]
    cell = cell_size(n)
    step = cell + 1
    cols = max(1, width_px // step)
    rows = math.ceil(n / cols)
    image = np.full((rows * step, cols * step, 3), 255, dtype=np.uint8)
    for block_id, colour in enumerate(block_colours(data)):
        y, x = divmod(block_id, cols)
        image[y * step : y * step + cell, x * step : x * step + cell] = colour
    return image


def render_kv_map(data: dict) -> Figure:
    """The whole picture as a matplotlib Figure (no pyplot state). ``fig.kv_grid_box`` is the grid's
    (left, top, width, height) in pixels of the saved PNG, for tools that read the squares back."""
    from matplotlib.figure import Figure

    grid = grid_image(data, WIDTH_PX - 2 * MARGIN_PX)
    windowed = data.get("window_group")
    window_grid = None
    if windowed is not None:
        window_grid = grid_image({**windowed, "palette": data["palette"]}, WIDTH_PX - 2 * MARGIN_PX)
    window_px = 0 if window_grid is None else WINDOW_TITLE_PX + window_grid.shape[0] + 8
    height_px = TITLE_PX + grid.shape[0] + LEGEND_PX + window_px + PANEL_PX
    fig = Figure(figsize=(WIDTH_PX / DPI, height_px / DPI), dpi=DPI, facecolor="white")
    fig.figimage(grid, xo=MARGIN_PX, yo=height_px - TITLE_PX - grid.shape[0], origin="upper")
    fig.kv_grid_box = (MARGIN_PX, TITLE_PX, grid.shape[1], grid.shape[0])
    if window_grid is not None:
        _window_grid(fig, windowed, window_grid, TITLE_PX + grid.shape[0] + LEGEND_PX, height_px)
    counters, counts = data["counters"], data["counts"]
    title = (
        f"pagedkv KV cache: {data['num_blocks']} blocks of {data['block_size']} tokens   "
        f"hit rate {100 * counters.get('prefix_cache_hit_rate', 0.0):.1f}%   "
        f"evictions {int(counters.get('evictions', 0))}   preemptions {int(counters.get('num_preemptions', 0))}"
    )
    fig.text(MARGIN_PX / WIDTH_PX, 1 - 28 / height_px, title, fontsize=12, weight="bold")
    _legend(fig, data, counts, (TITLE_PX + grid.shape[0] + 22) / height_px)
    panel_top = 1 - (TITLE_PX + grid.shape[0] + LEGEND_PX + window_px) / height_px
    _tree(fig, data["prefix_tree"], panel_top, height_px)
    _charts(fig, data, panel_top, height_px)
    return fig


def _window_grid(fig: Figure, windowed: dict, grid: np.ndarray, top_px: int, height_px: int) -> None:
    """The sliding-window layers' group under the main grid: a caption, then its squares; ``fig.kv_window_grid_box``
    is their (left, top, width, height) in pixels, as ``kv_grid_box`` is the main grid's."""
    counts = windowed["counts"]
    caption = (
        f"sliding-window layers (window {windowed['window']} tokens): {windowed['num_blocks']} blocks of their own, "
        f"{counts['held'] + counts['shared']} held, {counts['cached']} cached"
    )
    fig.text(MARGIN_PX / WIDTH_PX, 1 - (top_px + 18) / height_px, caption, fontsize=10, weight="bold")
    grid_top = top_px + WINDOW_TITLE_PX
    fig.figimage(grid, xo=MARGIN_PX, yo=height_px - grid_top - grid.shape[0], origin="upper")
    fig.kv_window_grid_box = (MARGIN_PX, grid_top, grid.shape[1], grid.shape[0])


def save_kv_map(data: dict, path: str | os.PathLike) -> Path:
    """Render ``data`` (the JSON of ``/kv.json``) to a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = render_kv_map(data)
    FigureCanvasAgg(fig)
    path = Path(path)
    fig.savefig(path, dpi=DPI, facecolor="white")
    return path


def _rgb(value: str) -> np.ndarray:
    return np.array(list(bytes.fromhex(value.lstrip("#"))), dtype=np.float64)


def _legend(fig: Figure, data: dict, counts: dict, y_from_top: float) -> None:
    palette = data["palette"]
    labels = {"held": "held (1 request)", "shared": "shared", "cached": "cached, free (light: evicted next)"}
    x = MARGIN_PX / WIDTH_PX
    for state in STATES:
        colour = palette["cached_last"] if state == CACHED else palette[state]
        text = f"\u25a0 {labels.get(state, state)}: {counts[state]}"
        fig.text(x, 1 - y_from_top, text, color=colour if state != "empty" else "#888888", fontsize=10)
        x += (len(text) * 7 + 24) / WIDTH_PX


def _tree_lines(nodes: list[dict], depth: int = 0) -> list[str]:
    lines: list[str] = []
    for node in nodes:
        holders = f"held by {node['num_requests']}" if node["num_requests"] else "free"
        lines.append(
            f"{'  ' * depth}{'└ ' if depth else ''}{node['blocks']} block{'s' if node['blocks'] > 1 else ''} · "
            f"{node['hits']} hits · {holders} · "
            f"{node['subtree_blocks']} in subtree  {node['key']}"
        )
        lines += _tree_lines(node["children"], depth + 1)
        if node["more_children"]:
            lines.append(f"{'  ' * (depth + 1)}+ {node['more_children']} more")
    return lines


def _tree(fig: Figure, tree: dict, top: float, height_px: int) -> None:
    lines = _tree_lines(tree["roots"]) or ["no cached prefixes yet"]
    if tree["more_roots"]:
        lines.append(f"+ {tree['more_roots']} more prefixes")
    if len(lines) > MAX_TREE_LINES:
        lines = lines[: MAX_TREE_LINES - 1] + [f"... ({len(lines) - MAX_TREE_LINES + 1} more lines)"]
    x = MARGIN_PX / WIDTH_PX
    fig.text(x, top - 10 / height_px, "Hottest cached prefixes", fontsize=11, weight="bold", va="top")
    fig.text(x, top - 34 / height_px, "\n".join(lines), fontsize=8, family="monospace", va="top")


def _charts(fig: Figure, data: dict, top: float, height_px: int) -> None:
    history, palette = data["history"], data["palette"]
    now = history[-1]["t"] if history else 0.0
    t = [s["t"] - now for s in history]
    rate_t, rate = [], []
    for prev, cur in zip(history, history[1:]):
        if cur["queries"] > prev["queries"]:
            rate_t.append(cur["t"] - now)
            rate.append((cur["hits"] - prev["hits"]) / (cur["queries"] - prev["queries"]))
    panels = [
        ("hit rate per interval", [(rate_t, rate, palette["cached_last"], "hit rate")], (0, 1.02)),
        (
            "blocks",
            [
                (t, [s["blocks_used"] for s in history], palette["held"], "in use"),
                (t, [s["blocks_cached"] for s in history], palette["cached_last"], "keyed"),
            ],
            (0, data["num_blocks"] * 1.02),
        ),
        (
            "since start",
            [
                (t, [s["evictions"] for s in history], palette["shared"], "evictions"),
                (t, [s["preemptions"] for s in history], "#555555", "preemptions"),
            ],
            None,
        ),
    ]
    panel_h = (PANEL_PX - 40) / height_px
    each = panel_h / len(panels)
    for i, (title, series, ylim) in enumerate(panels):
        ax = fig.add_axes((0.56, top - 20 / height_px - (i + 1) * each + 0.25 * each, 0.32, 0.62 * each))
        for xs, ys, colour, label in series:
            ax.plot(xs, ys, color=colour, label=label, linewidth=1.2, marker=".", markersize=4)
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        if ylim is not None:
            ax.set_ylim(*ylim)
        if i == len(panels) - 1:
            ax.set_xlabel("seconds before the snapshot", fontsize=8)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
