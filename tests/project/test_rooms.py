"""The package's rooms and the arrows between them: a module imports only from its own room or a lower one.

The rooms, bottom to top, follow the layers of docs/architecture.md: the small pure-Python pieces everything
uses; the engine's configuration; sampling parameters and the sampler; the KV cache; the compiled kernels; the
attention backends; tensor-parallel comms; the model; the engine; then the entry points: the offline LLM, the HTTP
server (what its APIs share, then the Ollama and Responses APIs, then the app that registers them all), the Ray
replicas (whose ingress is a server), the CLI over them all. An arrow that runs up ties a
lower room to everything above it (reading the config loaded torch and the kernels), so the scan below fails on
any new one. ``pagedkv/__init__.py`` is the package's lazy public face and may name any room.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv

PACKAGE = Path(__file__).resolve().parents[2] / "pagedkv"

# Bottom to top. A room is a subpackage, a group of the package root's loose modules, or (in entrypoints/) a
# subpackage or module of a subpackage: a module's room is the one naming the longest prefix of its dotted path.
ROOMS: list[tuple[str, set[str]]] = [
    ("foundation", {"errors", "extension", "json_text", "lark_base_case", "grammar_probe", "reasoning_grammar"}),
    ("config", {"config"}),
    ("sampling", {"structured", "sampling_params", "sampler"}),
    ("kv", {"kv", "kv_map"}),
    ("kernels", {"kernels", "kernel_ops"}),  # the compiled ops check pools against kv's layout and dtypes
    ("attention", {"attention"}),
    ("parallel", {"parallel"}),
    ("model", {"model"}),
    ("engine", {"engine"}),
    ("offline", {"entrypoints.llm"}),
    ("server", {"entrypoints.server"}),
    ("server APIs", {"entrypoints.server.ollama", "entrypoints.server.responses"}),
    ("server app", {"entrypoints.server.openai_server"}),
    ("replicas", {"entrypoints.replicas"}),
    ("cli", {"entrypoints", "entrypoints.cli"}),
]
# The names the lazy public face serves, and the module behind each: `from pagedkv import LLM` in a lower room is
# an arrow up to the entry points even though it names only the package.
FACE: dict[str, str] = pagedkv._LAZY
RANK = {place: rank for rank, (_, places) in enumerate(ROOMS) for place in places}
ROOM_NAME = {place: name for name, places in ROOMS for place in places}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    relative = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _imported_modules(path: Path) -> set[str]:
    """Every pagedkv module the file imports, at the top or inside a function (a lazy import is an arrow too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # `from pagedkv import kernels` imports a module, not the package face
                found.add(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
                if base == "pagedkv" and alias.name in FACE:  # through the face to the module behind it
                    found.add(FACE[alias.name])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pagedkv":
            found.update([FACE[node.attr]] if node.attr in FACE else [])  # `import pagedkv; pagedkv.LLM(...)`
    return {m for m in found if m == "pagedkv" or m.startswith("pagedkv.")}


def _place(module: str) -> str | None:
    """The longest prefix of the module's path (less ``pagedkv.``) that ROOMS names; None for the package face,
    or for a module no room names."""
    parts = module.split(".")[1:]
    prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
    return next((prefix for prefix in prefixes if prefix in RANK), None)


def _arrows() -> dict[tuple[str, str], None]:
    arrows: dict[tuple[str, str], None] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _module_name(path)
        if source == "pagedkv":
            continue  # the lazy public face
        for target in sorted(_imported_modules(path)):
            if _place(target) is not None and _place(target) != _place(source):
                arrows[(source, target)] = None
    return arrows


def test_every_module_has_a_room():
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")} - {"pagedkv"}
    assert sorted(m for m in modules if _place(m) is None) == [], "place these modules in a room in ROOMS"


def test_no_arrow_runs_up_a_room():
    upward = {(source, target) for source, target in _arrows() if RANK[_place(target)] > RANK[_place(source)]}
    assert not upward, f"imports from a higher room (move the shared piece down instead): {sorted(upward)}"


def test_no_cycle_between_rooms():
    """The rooms' arrows form no cycle, whatever order ROOMS lists them in.

    A second check beside the rank test: moving a room in ROOMS to make a new arrow legal still fails here if
    the arrow closes a loop.
    """
    edges = {(ROOM_NAME[_place(s)], ROOM_NAME[_place(t)]) for s, t in _arrows()}
    remaining = {name for name, _ in ROOMS}
    while remaining:  # peel off rooms that nothing left imports; a cycle never peels
        free = {r for r in remaining if not any(a in remaining and b == r and a != r for a, b in edges)}
        assert free, f"a loop of imports runs among these rooms: {sorted(remaining)}"
        remaining -= free


@pytest.mark.parametrize(
    ("module", "imported"),
    [
        ("pagedkv.engine.runner", "pagedkv.kv.manager"),  # from pagedkv.kv.manager import ...
        ("pagedkv.model.panel", "pagedkv.kernels"),  # from pagedkv import kernels
        ("pagedkv.entrypoints.cli", "pagedkv.kv_map"),  # inside a function
        ("pagedkv.entrypoints.cli", "pagedkv.entrypoints.llm"),  # from pagedkv import LLM, through the face
    ],
)
def test_the_scan_sees_imports(module, imported):
    """A guard on the scan itself: it finds arrows written each way the package writes them."""
    path = PACKAGE / Path(*module.split(".")[1:]).with_suffix(".py")
    assert imported in _imported_modules(path)


def test_reading_the_config_loads_neither_torch_nor_an_implementation():
    """The CLI, a router or a test reads EngineConfig without paying for torch and the kernels."""
    script = (
        "import sys, pagedkv.config; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pagedkv')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    assert loaded.stdout.split() == ["['pagedkv',", "'pagedkv.config']"]
