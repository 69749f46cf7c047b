"""Which kernels a process loads (issue 29): a wheel's prebuilt variant for the CPU, the first-use compile of a
checkout, or none, and what it says. No compiling here: the prebuilt directory is a fake one (a manifest and
empty files), and the load itself is what tests/project/test_wheel.py runs for real."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from pagedkv import extension, kernels

V1 = "flags\t\t: fpu cx8 cmov sse sse2 lm"  # plain x86-64 (a Core 2 / K8)
V2 = V1 + " pni ssse3 sse4_1 sse4_2 popcnt cx16 lahf_lm"
V3 = V2 + " avx avx2 fma f16c bmi1 bmi2 movbe"
V4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"
PACKAGE = Path(kernels.__file__).parent
CSRC = PACKAGE / "csrc"


def digests(csrc: Path) -> dict[str, str]:
    """What setup.py records: each source's and header's SHA-256, by its path under the package, computed here
    with hashlib on the files' bytes (independently of pagedkv.extension)."""
    files = [p for p in csrc.iterdir() if p.suffix in (".cpp", ".h")]
    return {f"csrc/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_cpu_level():
    assert extension.cpu_level(V4) == "v4"
    assert extension.cpu_level(V3) == "v3"
    assert extension.cpu_level(V2) == "v2"
    assert extension.cpu_level(V3 + " avx512f") == "v3", "AVX-512F alone is not x86-64-v4"
    assert extension.cpu_level(V3.replace(" f16c", "")) == "v2", "AVX2 without F16C is not x86-64-v3"
    assert extension.cpu_level(V2.replace(" sse4_2", "")) is None
    assert extension.cpu_level(V1) is None
    assert extension.cpu_level("") is None
    assert extension.cpu_level() in ("v2", "v3", "v4", None)


@pytest.fixture
def prebuilt(monkeypatch, tmp_path):
    """A fake wheel's _lib for this torch (portable v2 + v3 + v4, GEMM v3); no variant forced; a v4 CPU."""
    directory = tmp_path / "_lib"
    directory.mkdir()
    manifest = {
        "torch": torch.__version__,
        "libraries": {
            "pagedkv_ops": {"v2": "pagedkv_ops_v2.so", "v3": "pagedkv_ops_v3.so", "v4": "pagedkv_ops_v4.so"},
            "pagedkv_gemm": {"v3": "pagedkv_gemm_v3.so"},
        },
        "sources": digests(CSRC),
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("PAGEDKV_KERNEL_DIR", str(directory))
    monkeypatch.delenv(kernels.VARIANT_ENV, raising=False)
    monkeypatch.setattr(kernels, "cpu_level", lambda: "v4")
    monkeypatch.setattr(kernels, "_choices", {})
    return directory


def test_a_checkout_compiles_on_first_use(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_KERNEL_DIR", str(tmp_path / "nothing"))
    monkeypatch.delenv(kernels.VARIANT_ENV, raising=False)
    monkeypatch.setattr(kernels, "_choices", {})
    assert kernels.kernel_choice().variant == "jit"


def test_the_wheel_loads_the_cpus_variant(prebuilt, caplog, monkeypatch):
    with caplog.at_level(logging.INFO):
        choice = kernels.kernel_choice()
        assert kernels.kernel_choice() is choice
    assert choice.variant == "v4"
    assert choice.library("pagedkv_ops") == prebuilt / "pagedkv_ops_v4.so"
    assert choice.library("pagedkv_gemm") == prebuilt / "pagedkv_gemm_v3.so", "one GEMM for both levels"
    lines = [r.getMessage() for r in caplog.records if "prebuilt kernels" in r.getMessage()]
    assert lines == [f"pagedkv: prebuilt kernels, variant v4: x86-64-v4 (AVX-512), from {prebuilt}"]
    monkeypatch.setattr(kernels, "cpu_level", lambda: "v3")
    monkeypatch.setattr(kernels, "_choices", {})
    assert kernels.kernel_choice().library("pagedkv_ops") == prebuilt / "pagedkv_ops_v3.so"
    assert kernels.kernel_choice().library("pagedkv_gemm") == prebuilt / "pagedkv_gemm_v3.so"


def test_a_v2_cpu_gets_the_portable_ops_and_says_the_gemm_is_missing(prebuilt, monkeypatch, caplog):
    """x86-64-v2 (SSE4.2, no AVX2): the portable ops load, the GEMM (AVX2 + FMA) does not, in one loud warning."""
    monkeypatch.setattr(kernels, "cpu_level", lambda: "v2")
    with caplog.at_level(logging.INFO):
        choice = kernels.kernel_choice()
    assert choice.variant == "v2"
    assert choice.library("pagedkv_ops") == prebuilt / "pagedkv_ops_v2.so"
    with pytest.raises(kernels.KernelsUnavailable, match="no pagedkv_gemm for v2"):
        choice.library("pagedkv_gemm")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "variant v2" in warnings[0] and "AVX2 + FMA" in warnings[0] and kernels.GEMM_SLOWER in warnings[0]


@pytest.mark.parametrize(
    ("forced", "variant"),
    [("v2", "v2"), ("v3", "v3"), ("v4", "v4"), ("jit", "jit"), ("none", "none"), ("auto", "v4"), ("", "v4")],
)
def test_forced_variants(prebuilt, monkeypatch, forced, variant):
    monkeypatch.setenv(kernels.VARIANT_ENV, forced)
    assert kernels.kernel_choice().variant == variant


def test_forcing_what_cannot_run(prebuilt, monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "cpu_level", lambda: "v3")
    monkeypatch.setenv(kernels.VARIANT_ENV, "v4")
    choice = kernels.kernel_choice()
    assert choice.variant == "none" and "not x86-64-v4 (AVX-512)" in choice.reason
    monkeypatch.setattr(kernels, "cpu_level", lambda: "v2")
    monkeypatch.setattr(kernels, "_choices", {})
    monkeypatch.setenv(kernels.VARIANT_ENV, "v3")
    choice = kernels.kernel_choice()
    assert choice.variant == "none" and "not x86-64-v3 (AVX2 + FMA)" in choice.reason
    monkeypatch.setattr(kernels, "cpu_level", lambda: "v3")
    monkeypatch.setenv(kernels.VARIANT_ENV, "v3")
    monkeypatch.setenv("PAGEDKV_KERNEL_DIR", str(tmp_path / "nothing"))
    choice = kernels.kernel_choice()
    assert choice.variant == "none" and "no prebuilt kernels" in choice.reason
    monkeypatch.setenv(kernels.VARIANT_ENV, "avx2")
    with pytest.raises(ValueError, match=kernels.VARIANT_ENV):
        kernels.kernel_choice()


def test_a_cpu_below_v2_runs_torch_with_one_warning(prebuilt, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "cpu_level", lambda: None)
    portable, gemm = kernels.portable.fresh(), kernels.gemm.fresh()
    with caplog.at_level(logging.INFO):
        assert portable.available() is False
        assert gemm.available() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "no compiled kernels: this CPU lacks SSE4.2 / POPCNT (x86-64-v2)" in warnings[0]
    assert kernels.SLOWER in warnings[0]
    with pytest.raises(RuntimeError, match="x86-64-v2"):
        portable.require("use kernels=False")


def test_another_torch_compiles_instead(prebuilt, monkeypatch, caplog):
    manifest = json.loads((prebuilt / "manifest.json").read_text())
    (prebuilt / "manifest.json").write_text(json.dumps({**manifest, "torch": "1.0.0"}))
    with caplog.at_level(logging.WARNING):
        assert kernels.kernel_choice().variant == "jit"
    assert "built for torch 1.0.0, not this torch" in caplog.text


def test_a_library_that_does_not_load_is_loud(prebuilt, caplog):
    (prebuilt / "pagedkv_ops_v4.so").write_bytes(b"not a library")
    library = kernels.portable.fresh()
    with caplog.at_level(logging.WARNING):
        assert library.available() is False
    assert "could not be loaded" in caplog.text and "pagedkv_ops_v4.so" in caplog.text
    assert "slower" in caplog.text


def test_changed_sources_are_compiled_instead(prebuilt, monkeypatch, caplog, tmp_path):
    """A checkout's build/ outlives edits to csrc/: a library whose sources changed since (or that the manifest
    does not vouch for) is not loaded; the edit is compiled on first use, or, where a variant was forced, none runs."""
    package = tmp_path / "pagedkv"
    shutil.copytree(CSRC, package / "csrc")
    monkeypatch.setattr(kernels, "_CSRC", package / "csrc")
    for library in ("portable", "gemm"):
        original = getattr(kernels, library)
        files = [package / "csrc" / p.name for p in original.files()]
        sources, headers = files[: len(original.sources)], files[len(original.sources) :]
        monkeypatch.setattr(
            kernels, library, kernels.CompiledLibrary(original.name, sources, headers, original.what, original.fallback)
        )
    assert kernels.kernel_choice().variant == "v4"
    with (package / "csrc" / "simd.h").open("a") as f:
        f.write("// an edit\n")
    monkeypatch.setattr(kernels, "_choices", {})
    with caplog.at_level(logging.INFO):
        assert kernels.kernel_choice().variant == "jit"
    assert "not built from this package's csrc/simd.h" in caplog.text and "make wheel" in caplog.text
    monkeypatch.setenv(kernels.VARIANT_ENV, "v3")
    choice = kernels.kernel_choice()
    assert choice.variant == "none" and "csrc/simd.h" in choice.reason
    monkeypatch.delenv(kernels.VARIANT_ENV)
    manifest = json.loads((prebuilt / "manifest.json").read_text())
    manifest["sources"] = digests(package / "csrc")
    (prebuilt / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(kernels, "_choices", {})
    assert kernels.kernel_choice().variant == "v4", "rebuilt from the edit: loaded again"
    del manifest["sources"]
    (prebuilt / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(kernels, "_choices", {})
    assert kernels.kernel_choice().variant == "jit", "a manifest without digests vouches for nothing"


def test_a_checkout_finds_its_make_wheel_build(monkeypatch, tmp_path):
    """setup.py's build_ext writes to build/lib.<platform>-<interpreter>/pagedkv/_lib; a wheel's _lib comes first."""
    monkeypatch.delenv("PAGEDKV_KERNEL_DIR", raising=False)
    tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    assert extension.checkout_build_directory() == PACKAGE.parent / "build" / f"lib.{tag}" / "pagedkv" / "_lib"
    fake = tmp_path / "pagedkv" / "extension.py"
    monkeypatch.setattr(extension, "__file__", str(fake))
    built = tmp_path / "build" / f"lib.{tag}" / "pagedkv" / "_lib"
    assert extension.prebuilt_directory() == fake.parent / "_lib", "nothing built: the (missing) wheel directory"
    built.mkdir(parents=True)
    (built / "manifest.json").write_text("{}")
    assert extension.prebuilt_directory() == built
    (fake.parent / "_lib").mkdir(parents=True)
    assert extension.prebuilt_directory() == fake.parent / "_lib", "an installed wheel's own libraries"
    monkeypatch.setenv("PAGEDKV_KERNEL_DIR", str(tmp_path / "given"))
    assert extension.prebuilt_directory() == tmp_path / "given"


def test_setup_py_builds_every_file_the_loader_checks():
    """setup.py (the wheel, and make test's build/) and kernels.py (the first-use compile, and the digests a build
    must match) name the same sources and headers, every one in csrc/: a file kernels.py lists but setup.py does
    not would leave make test's build/ unused (compiled again on first use), and one setup.py lacks would not be
    in the wheel's libraries."""
    names_in_setup = set(re.findall(r'([A-Za-z0-9_]+\.(?:cpp|h))"', (PACKAGE.parent / "setup.py").read_text()))
    names_in_kernels = {p.name for library in (kernels.portable, kernels.gemm) for p in library.files()}
    in_csrc = {p.name for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert names_in_setup == names_in_kernels == in_csrc
