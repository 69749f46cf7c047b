"""The compiled-extension cache: a killed build, a half-written library, concurrent first builds, a stuck
build and a cache directory another user could write must neither hang a start nor get a library loaded.

Builds use a one-op C++ source in a temporary ``PAGEDKV_CACHE_DIR``, each in a fresh process, as an engine
start would be. The op is registered through torch's stable C API (``torch/csrc/stable/library.h``): ~1 CPU s to
compile, where ``torch/library.h`` pulls in most of ATen (~6 CPU s) and the real kernels take ~60 s.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedkv import extension, kernels
from pagedkv.attention import paged

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler here: nothing can be built")
REPO = Path(__file__).resolve().parents[2]
NAME = "pagedkv_tiny"
TINY_SOURCE = """#include <torch/csrc/stable/library.h>

int64_t add_one(int64_t x) { return x + 1; }

STABLE_TORCH_LIBRARY(pagedkv_test, m) { m.def("add_one(int x) -> int"); }
STABLE_TORCH_LIBRARY_IMPL(pagedkv_test, CompositeExplicitAutograd, m) { m.impl("add_one", TORCH_BOX(&add_one)); }
"""
# A new engine start: load or build the tiny op, call it, say whether the slow path (a build) was taken.
START = f"""
import sys
from pathlib import Path
import torch
from pagedkv import extension
source = Path(sys.argv[1])
extension.load_or_build({NAME!r}, source, (), (), extension.build_directory(source, (), prefix="test-"))
print(torch.ops.pagedkv_test.add_one(41), "torch.utils.cpp_extension" in sys.modules)
"""
HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def tiny(monkeypatch, tmp_path) -> Path:
    """The tiny op's source, with an empty cache of its own."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    return source


def tiny_directory(source: Path) -> Path:
    return extension.build_directory(source, (), prefix="test-")


def start(source: Path) -> subprocess.Popen:
    """An engine start in its own process group (a kill takes its compiler with it)."""
    args = [sys.executable, "-c", START, str(source)]
    return subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finish(process: subprocess.Popen, timeout: float = 150) -> tuple[int, bool]:
    """The op's answer and whether this start built the library (a start that hangs is killed, compiler too)."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, err[-3000:]
    answer, built = out.split()
    return int(answer), built == "True"


@pytest.fixture
def spies(monkeypatch) -> dict[str, list]:
    """Record, instead of doing, every library load and every build."""
    from torch.utils import cpp_extension

    calls: dict[str, list] = {"load_library": [], "build": []}
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls["load_library"].append(path))

    def fake_build(**kwargs):
        calls["build"].append(sorted(p.name for p in Path(kwargs["build_directory"]).iterdir()))
        raise RuntimeError("stop before compiling")

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    return calls


@needs_compiler
@pytest.mark.timeout(180)
def test_start_after_a_killed_build_builds_and_loads(tiny):
    """A build SIGKILLed mid-way leaves torch's lock file and a half-written library; the next start must
    neither wait forever on the lock nor load the library, but build afresh."""
    directory = tiny_directory(tiny)
    victim = start(tiny)
    deadline = time.monotonic() + 60
    while not (directory / "build.ninja").exists():  # written under torch's lock, just before ninja runs
        assert victim.poll() is None, victim.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first build never started"
        time.sleep(0.05)
    time.sleep(0.2)  # let the compiler start (it takes ~1 s to finish)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert (directory / "lock").exists()
    assert not (directory / extension.DONE_FILE).exists()
    (directory / f"{NAME}.so").write_bytes(b"\x7fELF\x02\x01\x01 cut short")

    began = time.monotonic()
    assert finish(start(tiny)) == (42, True)
    assert (directory / extension.DONE_FILE).exists()
    print(f"start after the killed build: {time.monotonic() - began:.1f} s")


@needs_compiler
@pytest.mark.timeout(180)
def test_concurrent_first_builds_share_one_library(tiny):
    """Two first starts at once: one builds while the other waits, then both run the op; the start after
    them loads the finished library without importing torch.utils.cpp_extension (~0.4 s)."""
    first, second = start(tiny), start(tiny)
    results = [finish(first), finish(second)]
    assert [answer for answer, _ in results] == [42, 42]
    assert sorted(built for _, built in results) == [False, True], "exactly one start builds"
    assert finish(start(tiny), timeout=60) == (42, False)


@pytest.mark.timeout(60)
def test_wait_for_a_live_build_times_out_then_a_killed_holder_frees_the_lock(tiny, spies, monkeypatch):
    directory = tiny_directory(tiny)
    extension.make_private_directory(directory)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(directory / extension.LOCK_FILE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(extension, "BUILD_WAIT_S", 0.5)
        with pytest.raises(extension.BuildInProgress, match=str(directory)) as info:  # not the 300 s default:
            extension.load_or_build(NAME, tiny, (), (), directory)  # the test's 60 s timeout would end it first
        assert holder.poll() is None, "it waited for the holder to go, not for its own limit"
        assert "fuser" in str(info.value)
        assert spies == {"load_library": [], "build": []}
    finally:
        holder.kill()
        holder.wait()
    (directory / "lock").touch()  # torch's lock, as the killed holder might have left it
    with pytest.raises(RuntimeError, match="stop before compiling"):
        extension.load_or_build(NAME, tiny, (), (), directory)
    assert spies["build"] == [[extension.LOCK_FILE]], "the build starts in an emptied directory"


def test_unfinished_library_is_wiped_not_loaded(tiny, spies):
    """A library without the done marker (a build killed while linking) is never loaded."""
    directory = tiny_directory(tiny)
    extension.make_private_directory(directory)
    for name in (f"{NAME}.so", "tiny.o", "build.ninja", ".ninja_log"):
        (directory / name).write_bytes(b"\x7fELF\x02\x01\x01 cut short")
    with pytest.raises(RuntimeError, match="stop before compiling"):
        extension.load_or_build(NAME, tiny, (), (), directory)
    assert spies["load_library"] == []
    assert spies["build"] == [[extension.LOCK_FILE]]


def test_finished_library_loads_without_a_build(tiny, spies):
    directory = tiny_directory(tiny)
    extension.make_private_directory(directory)
    (directory / f"{NAME}.so").write_bytes(b"a library")
    (directory / extension.DONE_FILE).write_text(f"{NAME}.so\n")
    extension.load_or_build(NAME, tiny, (), (), directory)
    assert spies == {"load_library": [str(directory / f"{NAME}.so")], "build": []}


def nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


@pytest.mark.parametrize("level", ["cache root", "torch_extensions", "build directory", "library"])
@pytest.mark.parametrize("how", ["group-writable", "others-writable", "another owner"])
def test_unsafe_cache_is_refused_before_any_load(tiny, spies, level, how):
    """A library is run as our code, so a directory someone else can write is refused before anything in it
    is loaded (here a planted, finished-looking library)."""
    if how == "another owner" and os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    directory = tiny_directory(tiny)
    extension.make_private_directory(directory)
    library = directory / f"{NAME}.so"
    library.write_bytes(b"planted")
    library.chmod(0o755)
    (directory / extension.DONE_FILE).write_text(f"{NAME}.so\n")
    target = {
        "cache root": directory.parent.parent,
        "torch_extensions": directory.parent,
        "build directory": directory,
        "library": library,
    }[level]
    if how == "another owner":
        os.chown(target, nobody(), -1)
    else:
        target.chmod(target.stat().st_mode | (0o020 if how == "group-writable" else 0o002))
    with pytest.raises(extension.UnsafeCacheDirectory, match=str(target)) as info:
        extension.load_or_build(NAME, tiny, (), (), directory)
    assert ("chown" if how == "another owner" else f"chmod go-w {target}") in str(info.value)
    assert isinstance(info.value, PermissionError)
    assert spies == {"load_library": [], "build": []}


def test_umask_002_still_makes_private_directories(tiny):
    directory = tiny_directory(tiny)
    before = os.umask(0o002)
    try:
        extension.make_private_directory(directory)
    finally:
        os.umask(before)
    for path in (directory, directory.parent, directory.parent.parent):
        assert path.stat().st_mode & 0o777 == 0o700, path


def test_unsafe_cache_stops_engine_start(monkeypatch, tmp_path, caplog):
    """Not a silent fallback to the slow torch path: the backend choice at engine start raises, every time,
    with the message naming the directory; an explicit torch backend does not touch the cache."""
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o775)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(root))
    monkeypatch.setenv(kernels.VARIANT_ENV, "jit")  # the cache is used, not a checkout's build/ (make wheel)
    monkeypatch.delenv(paged.ENV_VAR, raising=False)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "portable", kernels.portable.fresh())
    monkeypatch.setattr(kernels, "gemm", kernels.gemm.fresh())
    for _ in range(2):
        with pytest.raises(extension.UnsafeCacheDirectory, match=f"{root} is writable by group"):
            paged.select_backend(None)
        with pytest.raises(extension.UnsafeCacheDirectory, match=f"chmod go-w {root}"):
            kernels.use_kernels(True)
    with pytest.raises(extension.UnsafeCacheDirectory):  # also waits for its build thread, which must end here
        kernels.gemm.available()
    assert paged.select_backend("gather").name == "gather"
    assert kernels.use_kernels(False) is False
    assert "could not be built" not in caplog.text


def test_other_build_failures_still_fall_back(caplog):
    library = kernels.CompiledLibrary("pagedkv_tiny", [], [], "tiny ops", "torch runs instead")
    attempts = []

    def broken():
        attempts.append(1)
        raise RuntimeError("error: no compiler")

    library.build = broken
    assert library.available() is False
    assert library.available() is False
    assert attempts == [1], "one attempt per process"
    assert "could not be built (RuntimeError: error: no compiler); torch runs instead" in caplog.text
    with pytest.raises(RuntimeError, match="tiny ops are not available .*: use torch"):
        library.require("use torch")
