"""Reading a KV map back from pixels: find the block squares in an image and name each one's state.

Used on the PNG of ``pagedkv.kv_map`` and on a browser's screenshot of ``GET /kv``: the squares are found
from the pixels alone (bands of non-white rows, runs of non-white pixels in each band's middle row), so a
picture that draws too few or too many blocks, or the wrong colours, is caught.
"""

from __future__ import annotations

import numpy as np

WHITE_THRESHOLD = 250  # a pixel whose channels are all above this is background


def _rgb(value: str) -> np.ndarray:
    value = value.lstrip("#")
    return np.array([int(value[i : i + 2], 16) for i in (0, 2, 4)], dtype=np.float64)


def find_cells(image: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """(row, col, rgb) at the centre of every square in ``image`` ([H, W, 3+] uint8), in reading order."""
    rgb = image[..., :3].astype(np.int64)
    ink = ~(rgb > WHITE_THRESHOLD).all(axis=2)
    rows = np.flatnonzero(ink.any(axis=1))
    cells = []
    if rows.size == 0:
        return cells
    bands = np.split(rows, np.flatnonzero(np.diff(rows) > 1) + 1)
    for band in bands:
        y = int(band[(len(band) - 1) // 2])
        xs = np.flatnonzero(ink[y])
        for run in np.split(xs, np.flatnonzero(np.diff(xs) > 1) + 1):
            x = int(run[(len(run) - 1) // 2])
            cells.append((y, x, rgb[y, x].astype(np.float64)))
    return cells


def classify(colour: np.ndarray, palette: dict[str, str], tolerance: float = 12.0) -> str | None:
    """The state whose colour ``colour`` is (cached: anywhere on the shade from next-evicted to last)."""
    for state in ("held", "shared", "empty"):
        if np.abs(colour - _rgb(palette[state])).max() <= tolerance:
            return state
    a, b = _rgb(palette["cached_next"]), _rgb(palette["cached_last"])
    t = float(np.clip(np.dot(colour - a, b - a) / np.dot(b - a, b - a), 0.0, 1.0))
    if np.abs(colour - (a + t * (b - a))).max() <= tolerance:
        return "cached"
    return None


def states_in(image: np.ndarray, palette: dict[str, str]) -> list[str | None]:
    """The state of every square found in ``image``, in block-id (reading) order."""
    return [classify(colour, palette) for _, _, colour in find_cells(image)]
