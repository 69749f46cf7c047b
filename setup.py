"""The wheel's compiled kernels: the C++ libraries of :mod:`pagedkv.kernels`, built once at wheel-build time.

pyproject.toml holds the package's metadata; this file only adds the build of the kernels into
``pagedkv/_lib/`` (plain shared libraries that register ``torch.ops.pagedkv`` ops, loaded with
``torch.ops.load_library``, not Python modules):

- ``pagedkv_ops_v2.so``: the portable ops for x86-64-v2 (SSE4.2, POPCNT: Nehalem / Bulldozer on), the baseline
  that lets the wheel's compiled attention and norms run on any x86-64 CPU of the last fifteen years;
- ``pagedkv_ops_v3.so``: the same for x86-64-v3 (AVX2, FMA, F16C, BMI2: Haswell / Zen 1 on);
- ``pagedkv_ops_v4.so``: the same for x86-64-v4 (AVX-512 F/BW/CD/DQ/VL), where the compiler knows it;
- ``pagedkv_gemm_v3.so``: the panel GEMM for x86-64-v3, whose AVX-512 register kernels carry their own
  ``target("avx512f")`` attributes and are picked at run time, so one build serves both (as do the int8 GEMM's
  AVX512-VNNI kernels, picked by ``__builtin_cpu_supports``). A v2 CPU has no GEMM: torch's runs.

``manifest.json`` beside them names the torch they were built against: the loader uses them only with that
torch (the C++ ABI), and otherwise compiles on first use as a development checkout does; the wheel's metadata
requires that torch (``torch==2.13.0`` rather than pyproject's ``torch>=2.4``). It also holds the SHA-256 of each
source and header: a checkout loads the libraries this build leaves in ``build/`` only while its ``csrc/`` still
has those bytes (``make test`` builds the wheel first, so the suite runs on these libraries, compiled once).

Build with ``make wheel`` (``pip wheel --no-build-isolation --no-deps .``): the libraries link against the
torch installed in this environment, so the build must see it; an isolated build would download another
torch (a CUDA one, several GB, on Linux) and fails here instead, saying so. An editable install
(``pip install -e .``, ``make setup``) builds nothing: the development path compiles on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel as setuptools_bdist_wheel
from setuptools.command.build_ext import build_ext as setuptools_build_ext

CSRC = "pagedkv/csrc"
PORTABLE = [f"{CSRC}/{name}" for name in ("paged_attention.cpp", "rms_norm.cpp", "pointwise.cpp",
                                          "decoder_stack.cpp", "gguf_blocks.cpp")]
GEMM = [f"{CSRC}/panel_linear.cpp", f"{CSRC}/int8_linear.cpp"]
HEADERS = [f"{CSRC}/{name}" for name in ("simd.h", "int8_quantise.h", "int8_repack.h", "int8_tiled.h")]
# The JIT build's flags (pagedkv/kernels.py) with -march fixed per variant; -g0 against the build
# environment's -g (debug info would make the libraries several times larger).
CFLAGS = ["-O3", "-mtune=generic", "-fopenmp", "-g0"]
LDFLAGS = ["-fopenmp"]
# (library, variant, -march, sources)
LIBRARIES = [
    ("pagedkv_ops", "v2", "x86-64-v2", PORTABLE),
    ("pagedkv_ops", "v3", "x86-64-v3", PORTABLE),
    ("pagedkv_ops", "v4", "x86-64-v4", PORTABLE),
    ("pagedkv_gemm", "v3", "x86-64-v3", GEMM),
]
NEEDS_TORCH = (
    "pagedkv's wheel links its C++ kernels against the torch installed where it is built, so build it there: "
    "`make wheel`, or `pip wheel --no-build-isolation --no-deps .` in an environment with torch (pinned, e.g. "
    "`pip install torch==2.13.0`) and setuptools. An isolated build (plain `pip wheel .`) has no torch."
)


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def compiler_knows(march: str) -> bool:
    """Whether the C++ compiler accepts ``-march=<march>`` (x86-64-v4 needs GCC 11 / clang 12)."""
    try:
        result = subprocess.run([compiler(), f"-march={march}", "-x", "c++", "-E", "-o", os.devnull, os.devnull],
                                capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def torch_build_ext() -> type:
    """torch's BuildExtension (ninja, torch's include paths and ABI flags) when torch is importable, else
    setuptools' own (only an editable install, which builds nothing, gets that far)."""
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return setuptools_build_ext
    return BuildExtension.with_options(no_python_abi_suffix=True)


class build_ext(torch_build_ext()):  # noqa: N801 (setuptools' command name)
    """Builds :data:`LIBRARIES` into ``pagedkv/_lib``; nothing for an editable install."""

    def run(self) -> None:
        if getattr(self, "editable_mode", False):
            print("pagedkv: editable install, no kernels built: they are compiled on first use", file=sys.stderr)
            return
        try:
            import torch
            from torch.utils import cpp_extension
        except ImportError:
            raise SystemExit(NEEDS_TORCH) from None
        if platform.machine() not in ("x86_64", "AMD64"):
            raise SystemExit(f"pagedkv's prebuilt kernels are for x86-64, not {platform.machine()}: "
                             "install from source (`pip install -e .`), which compiles them on first use")
        if shutil.which(compiler()) is None:
            raise SystemExit(f"no C++ compiler ({compiler()!r}) to build pagedkv's kernels: install g++")
        skipped = []
        for ext in list(self.extensions):
            march = ext.pagedkv_march
            if not compiler_knows(march):
                skipped.append(ext.name)
                self.extensions.remove(ext)
                continue
            ext.include_dirs = cpp_extension.include_paths()
            ext.library_dirs = cpp_extension.library_paths()
            ext.libraries = ["c10", "torch", "torch_cpu", "torch_python"]
            ext.language = "c++"
            ext.extra_compile_args = [*CFLAGS, f"-march={march}"]
            ext.extra_link_args = list(LDFLAGS)
        for name in skipped:
            print(f"pagedkv: {compiler()} does not know {name}'s -march: the wheel goes without it", file=sys.stderr)
        sources = source_digests()  # before compiling: an edit made during the build must not be vouched for
        super().run()
        self.write_manifest(torch.__version__, sources)

    def build_extension(self, ext: Extension) -> None:
        """Each library in a build directory of its own: v3 and v4 compile the same sources to different objects."""
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base

    def write_manifest(self, torch_version: str, sources: dict[str, str]) -> None:
        """``manifest.json``: the torch these libraries were built for, which file is which variant, and the
        digests of the sources they were compiled from."""
        if not self.extensions:
            return
        directory = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
        libraries: dict[str, dict[str, str]] = {}
        for ext in self.extensions:
            path = Path(self.get_ext_fullpath(ext.name))
            libraries.setdefault(ext.pagedkv_library, {})[ext.pagedkv_variant] = path.name
        version = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout.splitlines()
        manifest = {
            "torch": torch_version,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "compiler": version[0] if version else compiler(),
            "cflags": CFLAGS,
            "libraries": libraries,
            "sources": sources,
        }
        (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        BUILT_FOR["torch"] = torch_version


def source_digests() -> dict[str, str]:
    """``{path under pagedkv/: SHA-256}`` of every file the libraries are compiled from (pagedkv/extension.py's
    ``stale_sources`` compares them with the package's own)."""
    files = sorted({*PORTABLE, *GEMM, *HEADERS})
    return {Path(f).relative_to("pagedkv").as_posix(): hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in files}


BUILT_FOR: dict[str, str] = {}  # the torch the kernels were just built against, for the wheel's requirement


class bdist_wheel(setuptools_bdist_wheel):  # noqa: N801 (setuptools' command name)
    """A wheel with kernels requires the torch they were built against: ``Requires-Dist: torch==<version>``
    (the public version: 2.13.0+cpu and 2.13.0 share the C++ ABI) instead of pyproject's ``torch>=2.4``."""

    def write_wheelfile(self, distinfo_path: str, *args, **kwargs) -> None:
        """Called on the wheel's dist-info, whether made from egg-info or copied from pip's metadata step."""
        super().write_wheelfile(distinfo_path, *args, **kwargs)
        if "torch" not in BUILT_FOR:
            return
        pinned = f"torch=={BUILT_FOR['torch'].split('+')[0]}"
        metadata = Path(distinfo_path) / "METADATA"
        lines = metadata.read_text().split("\n")
        for i, line in enumerate(lines):
            if line.startswith("Requires-Dist: torch") and ";" not in line:  # not an extra's
                lines[i] = f"Requires-Dist: {pinned}"
        metadata.write_text("\n".join(lines))
        print(f"pagedkv: the wheel requires {pinned}, the torch its kernels were built against", file=sys.stderr)


def extension(library: str, variant: str, march: str, sources: list[str]) -> Extension:
    ext = Extension(f"pagedkv._lib.{library}_{variant}", sources=sources, depends=HEADERS)
    ext.pagedkv_library, ext.pagedkv_variant, ext.pagedkv_march = library, variant, march
    return ext


setup(
    ext_modules=[extension(*spec) for spec in LIBRARIES],
    cmdclass={"build_ext": build_ext, "bdist_wheel": bdist_wheel},
)
