"""The README stays short and every link in it and in the docs site resolves; the site builds strictly.

The site (mkdocs.yml, docs/) is built with ``mkdocs build --strict`` when mkdocs is installed (``make test``
installs it with the [docs] extra): a broken link or anchor, a nav entry with no page, or an API page whose
module cannot be collected fails the build, and so this test.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks, with inline code removed (links there are not links)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(INLINE_CODE.sub("", line))
    return lines


def anchors_of(path: Path) -> set[str]:
    """Heading ids as Python-Markdown's toc extension makes them (lower case, punctuation dropped, '-' joined)."""
    ids = set()
    for line in prose_lines(path):
        if match := re.match(r"#{1,6} (.+)", line):
            text = re.sub(r"[^\w\s-]", "", match.group(1)).strip().lower()
            ids.add(re.sub(r"[-\s]+", "-", text))
    return ids


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path):
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked here
                links.append(target)
    return links


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"


def test_the_quick_start_is_make_run_and_make_test():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", text, re.S)
    assert block is not None, "README.md lost its Quick start code block"
    assert [line.split("#")[0].strip() for line in block.group(1).splitlines()] == ["make run", "make test"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for link in relative_links(path):
        file_part, _, anchor = link.partition("#")
        target = (path.parent / file_part).resolve() if file_part else path
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors_of(target):
            broken.append(f"{link}: no heading with that anchor in {target.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


# A measurement's cell: a number or a range of numbers, with an optional unit, then nothing, a space, a bracket or a
# colon ("42", "0.14-0.18", "746 ms (485-833)", "1,284 MiB", "13.5x"); "512-bit ..." or "HTTP 4xx" is no number.
NUMBER_CELL = re.compile(
    r"[~<>]?\d[\d,.]*(?:e-?\d+)?(?:[-\u2013]\d[\d,.]*)?(?:\s?(?:x|%|s|ms|us|\u00b5s|KiB|MiB|GiB|MB|tok/s))?(?=$|[\s(:/])"
)
COMMAND = re.compile(r"benchmarks/[\w-]+\.py|pagedkv bench|(?:^|`)make [\w-]+", re.M)
HEADING = re.compile(r"#{1,6} ")


def tables(lines: list[str]) -> list[tuple[int, int]]:
    """(header line, line after the last row) of each Markdown table: a `|` line followed by its `|---|` rule."""
    found = []
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"\|[-:| ]+\|$", lines[i + 1]):
            found.append((i, next((k for k in range(i + 2, len(lines)) if not lines[k].startswith("|")), len(lines))))
    return found


def is_measured(rows: list[str]) -> bool:
    """At least a third of the cells past the row labels (and two or more) are numbers: a reference table of
    routes, options or types holds words, with at most a stray status code or byte count."""
    cells = [cell.strip() for row in rows for cell in row.strip().strip("|").split("|")[1:]]
    numbers = sum(bool(NUMBER_CELL.match(cell)) for cell in cells)
    return numbers >= 2 and 3 * numbers >= len(cells)


def measured_tables(path: Path) -> list[tuple[int, str]]:
    """(line number, header) of each table of measurements in the file whose section (from the heading above it
    to the next heading) names no command: a ``benchmarks/`` script, ``pagedkv bench`` or a make target."""
    lines = path.read_text().splitlines()
    missing = []
    for header, end in tables(lines):
        if not is_measured(lines[header + 2 : end]):
            continue
        start = next((k for k in range(header, -1, -1) if HEADING.match(lines[k])), 0)
        stop = next((k for k in range(end, len(lines)) if HEADING.match(lines[k])), len(lines))
        if not COMMAND.search("\n".join(lines[start:stop])):
            missing.append((header + 1, lines[header][:80]))
    return missing


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_of_measurements_has_its_command(path):
    assert measured_tables(path) == [], "name the command that printed each table in its section"


def test_the_table_check_tells_measurements_from_references(tmp_path):
    """A guard on the check itself: a table of numbers needs a command in its own section, a table of words
    does not, and a command in another section does not count."""
    page = tmp_path / "page.md"
    measured = "| engine | tok/s | TTFT |\n|---|---:|---:|\n| a | 42 | 66 ms |\n| b | 0.14-0.18 | 746 ms (485-833) |\n"
    reference = "| route | what |\n|---|---|\n| `/health` | 200 while serving |\n| `/v1/models` | the model |\n"
    page.write_text(f"# A\n\n`python benchmarks/x.py`\n\n{measured}\n## B\n\n{measured}\n## C\n\n{reference}")
    assert measured_tables(page) == [(12, "| engine | tok/s | TTFT |")]
    assert not is_measured(["| Q4_K | 512-bit `maddubs` |", "| AVX2 | 256-bit `madd` |"])


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) `[code](not-a-link.md)`\n```\n[x](fenced.md)\n```\n")
    assert relative_links(page) == ["#title", "missing.md"]
    assert anchors_of(page) == {"title"}


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed: pip install '.[docs]'")
def test_the_docs_site_builds_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "engine" / "index.html").exists()  # the docstrings were rendered


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML is not installed (mkdocs brings it)")
def test_every_page_is_in_the_nav_once():
    import yaml

    def pages(entries) -> list[str]:
        out = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out += pages(value) if isinstance(value, list) else [value]
        return out

    listed = pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert sorted(p for p in set(listed) if listed.count(p) > 1) == [], "pages listed twice in mkdocs.yml's nav"
