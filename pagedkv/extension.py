"""Compile-on-first-use C++ ops (the paged decode kernel, the Q4 linear), cached once per machine.

A build lives in ``<cache_root>/torch_extensions/<prefix><hash>``; the hash covers the source, the flags,
torch, Python and the CPU's instruction set, so a build is reused only where it is valid (``-march=native``
code must not run on another CPU). Concurrent first builds in one directory are serialised by torch's lock
file there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pagedkv.config import cache_root

logger = logging.getLogger(__name__)

STALE_LOCK_S = 600  # a build takes well under a minute; a lock this old belongs to a killed one


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


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


def load_or_build(
    name: str, source: Path | Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str], directory: Path
) -> None:
    """Load the cached library into ``torch.ops``, else compile it there (raises if that fails).

    A finished build (library present, no lock file of a build in progress) is loaded directly: importing
    ``torch.utils.cpp_extension`` and asking ninja would cost ~0.4 s at every engine start.
    """
    library, lock = directory / f"{name}.so", directory / "lock"
    if library.exists() and not lock.exists():
        try:
            torch.ops.load_library(str(library))
            return
        except (OSError, RuntimeError):
            logger.debug("cached %s did not load, trying a regular build", library, exc_info=True)
    from torch.utils import cpp_extension

    # torch waits for the lock file forever; one left by a killed build would hang every later start.
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing %s, left by a build that did not finish", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(source)] if isinstance(source, Path) else [str(s) for s in source],
        extra_cflags=list(cflags),
        extra_ldflags=list(ldflags),  # fresh lists: torch appends its own flags to them
        build_directory=str(directory),
        verbose=False,
        is_python_module=False,
    )


def summarize_error(exc: BaseException) -> str:
    """One line of a build failure: the compiler's first error if the message has one, else its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower()]
    line = errors[0] if errors else (lines[-1] if lines else "no message")
    return f"{type(exc).__name__}: {line}"[:300]


class BuildOnce:
    """The one build attempt per process of a compiled op: the op, or why there is none (thread-safe)."""

    def __init__(self, what: str, fallback: str) -> None:
        self.what = what  # names the op in the warning
        self.fallback = fallback  # says what runs instead
        self.tried = False
        self.op: Callable | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def fresh(self) -> BuildOnce:
        """A state that has not tried yet (tests use it to simulate a new process)."""
        return BuildOnce(self.what, self.fallback)

    def available(self, build: Callable[[], Callable]) -> bool:
        """Run ``build`` on the first call; False, with one warning, if it failed (no compiler, no ninja, ...)."""
        with self._lock:
            if not self.tried:
                self.tried = True
                try:
                    self.op = build()
                except Exception as exc:  # whatever stops the build means: use the fallback
                    self.error = summarize_error(exc)
                    logger.debug("%s build failed", self.what, exc_info=True)
                    logger.warning("pagedkv: the %s could not be built (%s); %s", self.what, self.error, self.fallback)
            return self.op is not None


def choose_backend(
    requested: str | None,
    env_var: str,
    choices: tuple[str, str],
    available: Callable[[], bool],
    what: str,
) -> str:
    """``choices[0]`` (a compiled op) or ``choices[1]`` (its PyTorch fallback) for ``what``.

    The argument wins, then ``$env_var``, then the compiled op if it builds. Asking for the compiled op
    where it cannot be built falls back with a warning rather than failing: an engine must start anyway.
    """
    compiled, fallback = choices
    source = f"the {what} argument"
    if requested is None and os.environ.get(env_var, "").strip():
        requested, source = os.environ[env_var].strip(), f"${env_var}"
    if requested is None:
        if available():
            return compiled
        logger.info("%s: %r (the compiled one is unavailable)", what, fallback)
        return fallback
    if requested not in choices:
        raise ValueError(f"{what} {requested!r} from {source} is not one of {choices}: use one of those")
    if requested == compiled and not available():
        logger.warning("%s %r was asked for by %s but cannot be built: using %r", what, compiled, source, fallback)
        return fallback
    return requested
