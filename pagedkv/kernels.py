"""pagedkv's compiled CPU ops: two libraries, built on first use and cached per machine (:mod:`pagedkv.extension`).

- :data:`portable` (``csrc/paged_attention.cpp``, ``rms_norm.cpp``, ``pointwise.cpp``, sharing ``csrc/simd.h``):
  attention over the paged pool, RMSNorm with the residual add, SiLU-and-multiply, RoPE. Written
  against the compiler's vector types, so it builds wherever a C++ compiler does. Also ``decoder_stack.cpp``,
  which runs a model's layers through these ops (and the GEMM, found by name) in one call from Python.
- :data:`gemm` (``csrc/panel_linear.cpp``, and ``csrc/int8_linear.cpp`` for ``weight_format="gguf-int8"``): the
  panel GEMM, written for AVX2 + FMA. A CPU without them
  loses only this library: the linear layers run on torch's GEMM and everything else stays compiled.

Where they come from (:func:`kernel_choice`): an installed wheel ships them prebuilt (``pagedkv/_lib``, see
``setup.py``) and the variant for this CPU is loaded, x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) or x86-64-v2
(SSE4.2: the portable ops only, the GEMM needs v3); a development checkout loads the same from ``build/`` after
``make wheel`` (``make test`` runs it) while their sources are unchanged, and otherwise compiles them with
``-march=native`` on first use. ``$PAGEDKV_KERNEL_VARIANT`` forces one (``v4``, ``v3``, ``v2``, ``jit`` or ``none``).

Every op registers in one namespace, ``torch.ops.pagedkv``; their Python faces are :mod:`pagedkv.kernel_ops`.
Where a library cannot be built, the engine runs torch's ops, which the tests hold to the same numbers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.extension import (
    LEVEL_NAMES,
    UnsafeCacheDirectory,
    build_directory,
    cpu_level,
    load_or_build,
    load_prebuilt,
    prebuilt_directory,
    prebuilt_libraries,
    stale_sources,
    summarize_error,
)

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
ENV_VAR = "PAGEDKV_KERNELS"
# No -ffast-math: the kernels rely on -inf (empty softmax max). -mtune=generic: -march=native also tunes for the
# CPU, and on AMD's Zen that splits `acc += v * v` into a multiply and an add where generic tuning fuses it --
# last bits that would differ from the wheel's libraries (built for x86-64-v3 / v4, tuned generically) and from
# one CPU to another; the same tuning everywhere gives the same bits.
CFLAGS = ("-O3", "-march=native", "-mtune=generic", "-fopenmp")
LDFLAGS = ("-fopenmp",)
VARIANT_ENV = "PAGEDKV_KERNEL_VARIANT"
VARIANTS = ("v4", "v3", "v2", "jit", "none")  # prebuilt for x86-64-v4 / -v3 / -v2, compiled on first use, torch's
PREBUILT = VARIANTS[:3]
# What running torch's ops costs, measured on the default model (SmolLM2-135M Q4_1, 64-token greedy decode, 2 busy
# cores): 15-19 tok/s with the prebuilt v4 kernels, 3.5-5.3 without any; 8.6-10.6 without the GEMM only.
SLOWER = "roughly 3-4x slower decoding"
GEMM_SLOWER = "roughly 2x slower decoding"


class KernelsUnavailable(RuntimeError):
    """No library is to be loaded here (forced off, or the CPU lacks what the prebuilt ones need)."""


@dataclass(frozen=True)
class KernelChoice:
    """Where this process's libraries come from: ``variant`` is one of :data:`VARIANTS`."""

    variant: str
    directory: Path | None = None  # the prebuilt libraries' directory (v2 / v3 / v4)
    files: dict | None = None  # the manifest's {library name: {variant: file name}}
    reason: str = ""  # why (for "none": why no library loads)

    def library(self, name: str) -> Path:
        """The prebuilt file of library ``name`` for this variant, or the best lower one the wheel has (the GEMM
        is built for x86-64-v3 only: its AVX-512 kernels are picked at run time; a v2 CPU has none)."""
        variants = (self.files or {}).get(name, {})
        for variant in PREBUILT[PREBUILT.index(self.variant) :]:
            if variant in variants:
                return self.directory / variants[variant]
        raise KernelsUnavailable(f"the prebuilt kernels in {self.directory} have no {name} for {self.variant} or below")


_choice_lock = threading.Lock()
_choices: dict[tuple[str, str], KernelChoice] = {}


def kernel_choice() -> KernelChoice:
    """This process's :class:`KernelChoice`, decided (and logged, once) on first use:

    ``$PAGEDKV_KERNEL_VARIANT`` if set; else the wheel's prebuilt libraries for this CPU's level (v4, v3, v2) if the
    package ships them for the running torch; else the first-use compile of a development checkout ("jit"); a
    CPU below x86-64-v2 with only the prebuilt libraries gets "none" (torch's ops).
    """
    forced = os.environ.get(VARIANT_ENV, "").strip().lower()
    forced = "" if forced == "auto" else forced
    if forced not in ("", *VARIANTS):
        raise ValueError(f"${VARIANT_ENV}={forced!r}: set it to one of {', '.join(VARIANTS)}, or auto (or unset it)")
    directory = prebuilt_directory()
    key = (forced, str(directory))
    with _choice_lock:
        if key not in _choices:
            _choices[key] = choice = _choose(forced, directory)
            _log_choice(choice, forced)
        return _choices[key]


def _choose(forced: str, directory: Path) -> KernelChoice:
    if forced == "jit":
        return KernelChoice("jit")
    if forced == "none":
        return KernelChoice("none", reason=f"${VARIANT_ENV}=none")
    manifest = prebuilt_libraries(directory)
    if manifest is None:
        if forced:
            return KernelChoice(
                "none",
                reason=f"${VARIANT_ENV}={forced} but there are no prebuilt kernels in "
                f"{directory} (build the wheel: `make wheel`)",
            )
        return KernelChoice("jit")  # a development checkout
    built_for = manifest.get("torch")
    if built_for != torch.__version__:
        logger.warning(
            "pagedkv: the prebuilt kernels in %s were built for torch %s, not this torch %s, so they are not "
            "loaded: compiling them here instead (needs a C++ compiler); install torch==%s to use them",
            directory,
            built_for,
            torch.__version__,
            built_for,
        )
        return KernelChoice("jit")
    stale = stale_sources(manifest, _CSRC.parent, (f for library in (portable, gemm) for f in library.files()))
    if stale:
        why = (
            f"the prebuilt kernels in {directory} were not built from this package's {', '.join(stale[:3])}"
            f"{' ...' if len(stale) > 3 else ''} (rebuild them: `make wheel`)"
        )
        if forced:
            return KernelChoice("none", reason=f"${VARIANT_ENV}={forced} but {why}")
        logger.info("pagedkv: %s: compiling them here instead", why)
        return KernelChoice("jit")
    level = cpu_level()
    if forced:
        if level is None or PREBUILT.index(forced) < PREBUILT.index(level):
            return KernelChoice("none", reason=f"${VARIANT_ENV}={forced} but this CPU is not {LEVEL_NAMES[forced]}")
        return KernelChoice(forced, directory, manifest["libraries"])
    if level is None:
        return KernelChoice(
            "none",
            reason="this CPU lacks SSE4.2 / POPCNT (x86-64-v2), which the prebuilt kernels "
            "need; a source install (`pip install -e .`) compiles them for it",
        )
    return KernelChoice(level, directory, manifest["libraries"])


def _log_choice(choice: KernelChoice, forced: str) -> None:
    how = f" (forced by ${VARIANT_ENV})" if forced else ""
    if choice.variant == "v2":  # the portable ops only: loud, as the GEMM's absence costs about half the speed
        logger.warning(
            "pagedkv: prebuilt kernels, variant v2: %s, from %s%s; the panel GEMM needs AVX2 + FMA "
            "(x86-64-v3), so the linear layers run on torch's GEMM, %s",
            LEVEL_NAMES["v2"],
            choice.directory,
            how,
            GEMM_SLOWER,
        )
    elif choice.variant in LEVEL_NAMES:
        logger.info(
            "pagedkv: prebuilt kernels, variant %s: %s, from %s%s",
            choice.variant,
            LEVEL_NAMES[choice.variant],
            choice.directory,
            how,
        )
    elif choice.variant == "jit":
        logger.debug("pagedkv: kernels compiled on first use (-march=native)%s", how)
    else:
        logger.warning("pagedkv: no compiled kernels: %s. torch's ops run instead, %s", choice.reason, SLOWER)


class CompiledLibrary:
    """One library of ``torch.ops.pagedkv`` ops, built from ``sources`` on first use, once per process.

    Where the build fails (no compiler, no ninja, an instruction set a source needs), :meth:`available` is
    False, with one warning saying what runs instead. An unsafe cache directory raises
    :class:`UnsafeCacheDirectory` instead, at every call: it is an error the user must fix, not a reason to
    run slower. Thread-safe: the engine thread and a server's startup may both ask.
    """

    def __init__(self, name: str, sources: Sequence[Path], headers: Sequence[Path], what: str, fallback: str) -> None:
        self.name = name
        self.sources, self.headers = tuple(sources), tuple(headers)
        self.what = what  # names the ops in messages
        self.fallback = fallback  # says what runs instead
        self.loaded = False
        self.error: str | None = None
        self._tried = False
        self._refused: str | None = None  # an unsafe cache's message, raised at every call
        self._how = "built"  # what failed, for the warning: "built" (compiled here) or "loaded" (prebuilt)
        self._lock = threading.Lock()

    def fresh(self) -> CompiledLibrary:
        """The same library in a process that has not tried to build it yet (tests simulate a new start)."""
        return CompiledLibrary(self.name, self.sources, self.headers, self.what, self.fallback)

    def files(self) -> tuple[Path, ...]:
        """Every file the library is compiled from: its sources and the headers they include."""
        return (*self.sources, *self.headers)

    def build_directory(self) -> Path:
        """Where these sources and headers, built with these flags for this torch, Python and CPU, live."""
        return build_directory(self.files(), CFLAGS + LDFLAGS, prefix=f"{self.name}-")

    def build(self) -> None:
        """Load the wheel's prebuilt library for this CPU, else compile and cache it (:func:`kernel_choice`)."""
        choice = kernel_choice()
        if choice.variant == "jit":
            load_or_build(self.name, self.sources, CFLAGS, LDFLAGS, self.build_directory())
        elif choice.variant == "none":
            raise KernelsUnavailable(choice.reason)
        else:
            self._how = "loaded"
            library = choice.library(self.name)
            load_prebuilt(library)
            logger.debug("loaded %s", library)

    def available(self) -> bool:
        """Load or build the library (first call in this process); False, with one warning, if that failed."""
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self.build()
                    self.loaded = True
                except UnsafeCacheDirectory as exc:
                    self._refused = self.error = str(exc)
                except KernelsUnavailable as exc:  # kernel_choice() has said so, in one warning for all libraries
                    self.error = str(exc)
                    logger.info("pagedkv: the %s are not loaded (%s); %s", self.what, self.error, self.fallback)
                except Exception as exc:  # whatever else stops the build means: use the fallback
                    self.error = summarize_error(exc)
                    logger.debug("%s build failed", self.what, exc_info=True)
                    logger.warning(
                        "pagedkv: the %s could not be %s (%s); %s", self.what, self._how, self.error, self.fallback
                    )
            if self._refused is not None:
                raise UnsafeCacheDirectory(self._refused)
            return self.loaded

    def start_building(self) -> None:
        """Load or build the library on a thread of its own, so that a first start compiles it while the
        caller builds another one (each build's compiler runs single-threaded for long stretches, and a
        2-core machine otherwise idles one core for the whole GEMM build). :meth:`available` then waits for it.
        """
        if not self._tried and not self._lock.locked():
            threading.Thread(target=self._available_quietly, name=f"build-{self.name}", daemon=True).start()

    def _available_quietly(self) -> None:
        with contextlib.suppress(UnsafeCacheDirectory):  # raised again at the caller's own available(), to fix
            self.available()

    def require(self, instead: str) -> None:
        """Raise RuntimeError naming ``instead`` unless the library is loaded (one attribute read once it is)."""
        if not self.loaded and not self.available():
            raise RuntimeError(f"the {self.what} are not available ({self.error}): {instead}")


def use_compiled(requested: bool | None, source: str, library: CompiledLibrary) -> bool:
    """Whether to run ``library``'s ops: never if ``requested`` is False, else if the library builds.

    Asked for (``requested`` True, from ``source``) where it cannot be built, this says so in a warning and
    returns False rather than failing: an engine must start anyway. An unsafe cache directory is the
    exception: :class:`UnsafeCacheDirectory` reaches the caller, so the user fixes it rather than running
    slower without knowing why.
    """
    if requested is False:
        return False
    if library.available():
        return True
    if requested:
        logger.warning("%s asked for the %s, which cannot be built here: %s", source, library.what, library.fallback)
    else:
        logger.info("the %s are unavailable: %s", library.what, library.fallback)
    return False


portable = CompiledLibrary(
    "pagedkv_ops",
    [
        _CSRC / name
        for name in ("paged_attention.cpp", "rms_norm.cpp", "pointwise.cpp", "decoder_stack.cpp", "gguf_blocks.cpp")
    ],
    [_CSRC / "simd.h"],
    what="compiled ops (paged attention, RMSNorm, SiLU, RoPE)",
    fallback=f"torch's ops run instead, {SLOWER} (attention_backend='gather', kernels=False skip the attempt)",
)
gemm = CompiledLibrary(
    "pagedkv_gemm",
    [_CSRC / "panel_linear.cpp", _CSRC / "int8_linear.cpp"],
    [_CSRC / name for name in ("int8_quantise.h", "int8_repack.h", "int8_tiled.h")],
    what="panel GEMM ops (AVX2 + FMA)",
    fallback=f"the linear layers run on torch's GEMM, {GEMM_SLOWER}",
)


def use_kernels(requested: bool | None) -> bool:
    """The ``kernels=`` option: ``requested``, else ``$PAGEDKV_KERNELS`` (1 or 0), else on where they build.

    On means the norms, SiLU and RoPE run compiled, and the linear layers too where :data:`gemm` builds.
    """
    source = "kernels=True"
    value = os.environ.get(ENV_VAR, "").strip()
    if requested is None and value:
        if value not in ("0", "1"):
            raise ValueError(f"${ENV_VAR}={value!r}: set it to 1 (compiled ops) or 0 (torch's ops), or unset it")
        requested, source = value == "1", f"${ENV_VAR}=1"
    if requested is not False:
        gemm.start_building()  # built beside the portable library, not after it
    on = use_compiled(requested, source, portable)
    if on and requested:
        use_compiled(requested, source, gemm)  # says so if the GEMM cannot be built
    return on
