"""The C++ libraries of :mod:`pagedkv.kernels`: prebuilt in a wheel, else compiled on first use and cached.

An installed wheel ships them in ``pagedkv/_lib/`` (``setup.py`` builds them: the portable ops for x86-64-v2, -v3
and -v4, the GEMM for x86-64-v3), with a ``manifest.json`` naming the torch they were built against and the
SHA-256 of every source file they were compiled from; :func:`prebuilt_libraries` and :func:`cpu_level` pick the
variant for this CPU. A development checkout has no ``_lib``: it uses the libraries its last ``make wheel`` left in
``build/`` (:func:`checkout_build_directory`) while their sources are the checkout's (:func:`stale_sources`, so
``make test`` compiles the kernels once, for the wheel and the suite alike), and otherwise compiles them with
``-march=native`` on first use, as below.

A build lives in ``<cache_root>/torch_extensions/<prefix><hash>``; the hash covers the source, the flags,
torch, Python and the CPU's instruction set, so a build is reused only where it is valid (``-march=native``
code must not run on another CPU).

The cache must never hang a start, load a broken library or run someone else's code:

- Builds in one directory are serialised by an ``fcntl.flock`` on ``build.flock`` there. The kernel drops
  the lock when its holder dies, so a killed build never blocks the next start, unlike torch's own ``lock``
  file (an O_EXCL file that torch waits on forever): whoever holds our lock knows any torch ``lock`` file
  is stale and removes it. Waiting for a live build gives up after :data:`BUILD_WAIT_S`.
- Only a finished build is trusted: ``build.done`` is written (atomically) once the library was built and
  loaded. Without it the directory's outputs, perhaps a half-written ``.so``, are wiped and rebuilt.
- Every cache directory must belong to the current user and be writable by no one else, checked before
  any library in it is loaded: whoever can write there can plant a ``.so`` that we would run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BUILD_WAIT_S = 300.0  # a build takes under a minute on 2 cores; a wait this long means a stuck build
LOCK_FILE = "build.flock"  # held (flock) by the process that checks or builds this directory
DONE_FILE = "build.done"  # written once the library was built and loaded: only then is it trusted
TORCH_LOCK_FILE = "lock"  # torch's FileBaton, left behind by a killed build


class UnsafeCacheDirectory(PermissionError):
    """A cache directory (or library) another user could write: loading from it could run their code."""


class BuildInProgress(TimeoutError):
    """Another live process has been building in the directory for longer than :data:`BUILD_WAIT_S`."""


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


# x86-64-v2: SSE3 (cpuinfo's "pni"), SSSE3, SSE4.1/4.2, POPCNT, CMPXCHG16B, LAHF (Nehalem / Bulldozer on)
V2_FLAGS = frozenset({"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"})
V3_FLAGS = V2_FLAGS | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2"}  # x86-64-v3 (also LZCNT, MOVBE: every such CPU)
V4_FLAGS = V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4
LEVEL_NAMES = {"v2": "x86-64-v2 (SSE4.2)", "v3": "x86-64-v3 (AVX2 + FMA)", "v4": "x86-64-v4 (AVX-512)"}
MANIFEST = "manifest.json"


def cpu_level(flags: str | None = None) -> str | None:
    """``"v4"``, ``"v3"``, ``"v2"`` or None: the highest x86-64 level whose prebuilt kernels this CPU runs.

    ``flags`` is /proc/cpuinfo's flags line (read if not given).
    """
    have = set((cpu_flags() if flags is None else flags).split())
    for level, needs in (("v4", V4_FLAGS), ("v3", V3_FLAGS), ("v2", V2_FLAGS)):
        if have >= needs:
            return level
    return None


def prebuilt_directory() -> Path:
    """Where the prebuilt libraries are: ``$PAGEDKV_KERNEL_DIR`` (tests), else an installed wheel's ``pagedkv/_lib``,
    else, in a checkout where ``make wheel`` ran, :func:`checkout_build_directory` (``pagedkv/_lib`` if neither is)."""
    override = os.environ.get("PAGEDKV_KERNEL_DIR")
    if override:
        return Path(override).expanduser()
    installed = Path(__file__).parent / "_lib"
    if installed.is_dir():
        return installed
    built = checkout_build_directory()
    return built if (built / MANIFEST).is_file() else installed


def checkout_build_directory() -> Path:
    """Where ``make wheel`` (``pip wheel .``, setuptools' ``build_ext``) leaves the libraries in a checkout:
    ``build/lib.<platform>-<interpreter>/pagedkv/_lib``, kept between builds, which only recompile what changed."""
    package = Path(__file__).parent
    platform_tag = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    return package.parent / "build" / f"lib.{platform_tag}" / package.name / "_lib"


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stale_sources(manifest: dict, package: Path, needed: Iterable[Path]) -> list[str]:
    """The files of ``needed`` (sources and headers, under ``package``) the manifest's libraries were not built from:
    unlisted in its ``sources`` (``{path under the package: SHA-256}``), missing, or changed since. Empty if none.

    A checkout's ``build/`` outlives edits to ``csrc/``: its libraries are used only while every file they were
    compiled from is, byte for byte, what the checkout has, so an edit is compiled on first use instead.
    """
    recorded = manifest.get("sources")
    recorded = recorded if isinstance(recorded, dict) else {}
    stale = []
    for path in needed:
        name = path.relative_to(package).as_posix()
        try:
            current = source_digest(path)
        except OSError:
            current = None
        if current is None or recorded.get(name) != current:
            stale.append(name)
    return stale


def prebuilt_libraries(directory: Path) -> dict | None:
    """The directory's manifest (``{"torch": version, "libraries": {name: {variant: file}}}``), None if none."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the prebuilt kernels in %s: unreadable %s (%s)", directory, MANIFEST, exc)
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("libraries"), dict):
        logger.warning("ignoring the prebuilt kernels in %s: %s names no libraries", directory, MANIFEST)
        return None
    return manifest


def load_prebuilt(library: Path) -> None:
    """Load a wheel's library into ``torch.ops`` (raises OSError / RuntimeError if it does not load).

    Unlike the cache it is not checked for ownership: it sits beside pagedkv's own Python code, as trusted.
    """
    if not library.is_file():
        raise FileNotFoundError(f"{library} is missing (a broken install? reinstall the wheel)")
    torch.ops.load_library(str(library))


def build_directory(source: Path | Sequence[Path], flags: Sequence[str], prefix: str = "") -> Path:
    """Where this source (or these sources), built with these flags for this torch, Python and CPU, lives."""
    sources = [source] if isinstance(source, Path) else list(source)
    key = hashlib.sha256()
    for part in (
        *(s.read_bytes() for s in sources),
        " ".join(flags).encode(),
        torch.__version__.encode(),
        sys.version.encode(),
        platform.machine().encode(),
        cpu_flags().encode(),
    ):
        key.update(part)
        key.update(b"\0")
    return cache_root() / "torch_extensions" / f"{prefix}{key.hexdigest()[:16]}"


def check_private(path: Path) -> None:
    """Raise :class:`UnsafeCacheDirectory` unless ``path`` is the current user's and no one else can write it."""
    info = path.stat()
    uid = os.geteuid()
    if info.st_uid != uid:
        raise UnsafeCacheDirectory(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {uid}), so pagedkv will not load compiled "
            f"code from it: `chown -R {uid} {path}`, or set PAGEDKV_CACHE_DIR to a directory of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheDirectory(
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}), so pagedkv will not "
            f"load compiled code from it: `chmod go-w {path}`"
        )


def make_private_directory(directory: Path) -> None:
    """Create the cache root and the directories below it down to ``directory`` (mode 0o700), checking each.

    Top down, so nothing is created or read inside a directory that is refused; 0o700 rather than the
    umask's default, so a umask of 002 does not get our own directories refused.
    """
    root = cache_root()
    if not directory.is_relative_to(root):
        raise ValueError(f"build directory {directory} is outside the cache root {root}: use build_directory()")
    root.parent.mkdir(parents=True, exist_ok=True)
    parts = directory.relative_to(root).parts
    for path in (root, *(root.joinpath(*parts[:i]) for i in range(1, len(parts) + 1))):
        path.mkdir(mode=0o700, exist_ok=True)
        check_private(path)


@contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build lock; raise :class:`BuildInProgress` after ``BUILD_WAIT_S`` s of waiting.

    ``flock`` rather than an O_EXCL file: the kernel releases it when the holder exits or is killed, so
    the lock can never be stale, and a wait here always waits for a live process.
    """
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + BUILD_WAIT_S
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BuildInProgress(
                        f"another process has been building in {directory} for over {BUILD_WAIT_S:.0f} s "
                        f"(`fuser -v {path}` shows which): let it finish, or stop it and start again"
                    ) from None
                if not waited:
                    logger.info("waiting for another process building in %s", directory)
                    waited = True
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def clear_outputs(directory: Path) -> None:
    """Remove everything a build left in ``directory`` but our lock file: the done marker first."""
    (directory / DONE_FILE).unlink(missing_ok=True)
    for entry in directory.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def load_or_build(
    name: str, source: Path | Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str], directory: Path
) -> None:
    """Load the cached library into ``torch.ops``, else compile it there (raises if that fails).

    A finished build (its done marker present) is loaded directly: importing ``torch.utils.cpp_extension``
    and asking ninja would cost ~0.4 s at every engine start. Otherwise, under the build lock, the
    directory is looked at again (another process may just have finished), then wiped and built.
    """
    make_private_directory(directory)
    library, done = directory / f"{name}.so", directory / DONE_FILE
    if _load_finished(library, done):
        return
    with exclusive_build(directory):
        if _load_finished(library, done):
            return
        if done.exists():
            logger.warning("cached %s did not load; building it again", library)
        if (directory / TORCH_LOCK_FILE).exists():
            logger.warning("removing %s, left by a build that did not finish", directory / TORCH_LOCK_FILE)
        clear_outputs(directory)
        from torch.utils import cpp_extension

        built = cpp_extension.load(
            name=name,
            sources=[str(source)] if isinstance(source, Path) else [str(s) for s in source],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),  # fresh lists: torch appends its own flags to them
            build_directory=str(directory),
            verbose=False,
            is_python_module=False,
        )
        mode = stat.S_IMODE(os.stat(built).st_mode)
        os.chmod(built, mode & ~(stat.S_IWGRP | stat.S_IWOTH))  # a umask of 002 must not get it refused
        partial = directory / f"{DONE_FILE}.tmp"
        partial.write_text(f"{Path(built).name}\n")
        os.replace(partial, done)


def _load_finished(library: Path, done: Path) -> bool:
    """Load ``library`` if its build finished; False if there is none or it does not load (then it is rebuilt)."""
    if not (done.exists() and library.exists()):
        return False
    check_private(library)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError):
        logger.debug("cached %s did not load", library, exc_info=True)
        return False
    return True


def summarize_error(exc: BaseException) -> str:
    """One line of a build failure: the compiler's first error if the message has one, else its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower()]
    line = errors[0] if errors else (lines[-1] if lines else "no message")
    return f"{type(exc).__name__}: {line}"[:300]


def cache_root() -> Path:
    """Root of pagedkv's per-machine caches (converted models, compiled ops).

    ``$PAGEDKV_CACHE_DIR`` if set, else ``~/.cache/pagedkv``.
    """
    override = os.environ.get("PAGEDKV_CACHE_DIR")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "pagedkv"
