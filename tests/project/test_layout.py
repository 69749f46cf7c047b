"""The tests' own layout (docs/testing.md, "Where a test lives"): every test file in a folder that mirrors a room
of the package, every folder a package (so two folders may hold files of the same name), and `make test-fast`'s
list naming only files that exist (a stale entry would drop a file from the fast run without a word)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import FAST_FILES

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_file_lies_loose_at_the_top():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == [], "move these into the folder of the room they test"


def test_every_folder_of_tests_is_a_package():
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    assert sorted(str(f) for f in folders if not (f / "__init__.py").is_file()) == [], "add an empty __init__.py"


def test_every_fast_file_exists():
    assert sorted(name for name in FAST_FILES if not (TESTS / name).is_file()) == []
