"""The wheel (issue 29): built with the kernels compiled in, installed into a fresh venv with no compiler reachable,
it runs the default model on its prebuilt kernels, the variant for this CPU or the one forced.

``make test`` (and so CI) builds the tagged wheel first (``make wheel``: four libraries from 17 sources, ~210-250
CPU seconds from a clean tree, seconds from an unchanged build/) and passes it here (``PAGEDKV_WHEEL=dist/....whl``);
the suite before this test loads the same libraries from build/ instead of compiling its own. ``make test-wheel``
runs this file alone; ``PAGEDKV_TEST_WHEEL=1`` builds an untagged wheel here (``pip wheel``) and tests that. Where
``make test`` cannot build one (no C++ compiler, not x86-64, no auditwheel) it says why in ``PAGEDKV_NO_WHEEL``,
and this test skips with that reason.

The venv holds pagedkv from the wheel only, installed with ``--no-deps``: its third-party dependencies (torch,
transformers, ...) come from this venv's site-packages through a ``.pth`` line. Installing them for real takes
minutes (torch alone ~2 min from the local wheel cache, the rest from the network); ``--system-site-packages``
would not reach them anyway (this venv is not the system's). A ``.pth`` path line adds the directory but runs no
``.pth`` file in it, so the editable install of the checkout (``__editable__...pth``) stays off: the test
checks that ``pagedkv`` is imported from the venv, and runs from a directory outside the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from pagedkv.extension import cpu_level

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("PAGEDKV_TEST_WHEEL") != "1" and not os.environ.get("PAGEDKV_WHEEL"),
        reason=f"no wheel to test: {os.environ.get('PAGEDKV_NO_WHEEL') or 'run by make test or make test-wheel'} "
        "(PAGEDKV_WHEEL names a built wheel; PAGEDKV_TEST_WHEEL=1 builds one here)",
    ),
    pytest.mark.skipif(cpu_level() is None, reason="the prebuilt kernels need an x86-64-v2 CPU (SSE4.2, POPCNT)"),
]


def build_wheel(out: Path) -> Path:
    given = os.environ.get("PAGEDKV_WHEEL")
    if given:
        return Path(given).resolve()
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or shutil.which("ninja") is None:
        pytest.skip(f"no C++ compiler ({compiler}) or ninja here: the wheel cannot be built")
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.skip("setuptools is not installed: the wheel cannot be built")
    env = {**os.environ, "MAX_JOBS": os.environ.get("MAX_JOBS", "1")}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--wheel-dir", str(out), str(REPO)],
        check=True,
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    (wheel,) = out.glob("pagedkv-*.whl")
    return wheel


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed: its python's directory."""
    root = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(root / "dist")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # a checkout on it is "already installed"
    )
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "_pagedkv_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def run_in(venv: Path, args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``args`` in the venv: no compiler on PATH (only the venv's bin), CC / CXX false, an empty cache."""
    environment = {
        "PATH": str(venv / "bin"),
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "CC": "false",
        "CXX": "false",
        "PAGEDKV_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        **env,
    }
    return subprocess.run(args, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)


def test_installed_from_the_wheel_without_the_checkout(venv, tmp_path):
    probe = "import pagedkv, shutil, sys; print(pagedkv.__file__); print(shutil.which('c++'), shutil.which('g++'))"
    result = run_in(venv, [str(venv / "bin" / "python"), "-c", probe], tmp_path)
    assert result.returncode == 0, result.stderr
    where, compilers = result.stdout.splitlines()
    assert Path(where).is_relative_to(venv), where
    assert compilers == "None None"
    libs = sorted(p.name for p in Path(where).parent.joinpath("_lib").iterdir())
    assert {"manifest.json", "pagedkv_ops_v2.so", "pagedkv_ops_v3.so", "pagedkv_gemm_v3.so"} <= set(libs), libs


@pytest.mark.parametrize("variant", ["auto", "v2", "v3", "v4", "none"])
def test_generate_on_the_prebuilt_kernels(venv, tmp_path, variant):
    """The default model generates with no compiler present: on the CPU's variant (logged), or the forced one; v2
    (what an SSE4.2-only CPU gets) runs the portable ops and torch's GEMM, and says so in one warning."""
    levels = ["v2", "v3", "v4"]
    if variant in levels and levels.index(variant) > levels.index(cpu_level()):
        pytest.skip(f"this CPU is below {variant}: that variant cannot run here")
    start = time.perf_counter()
    result = run_in(
        venv,
        [str(venv / "bin" / "pagedkv"), "-v", "generate", "hello", "--max-tokens", "4"],
        tmp_path,
        PAGEDKV_KERNEL_VARIANT=variant,
    )
    took = time.perf_counter() - start
    print(f"{variant}: first start and 4 tokens in {took:.1f} s")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "no text generated"
    log = result.stderr
    assert "could not be built" not in log and "could not be loaded" not in log, log[-3000:]
    assert not (tmp_path / "cache" / "torch_extensions").exists(), "something was compiled"
    if variant == "none":
        assert "WARNING pagedkv.kernels: pagedkv: no compiled kernels: $PAGEDKV_KERNEL_VARIANT=none" in log, log
        assert log.count("no compiled kernels") == 1, log
        return
    expected = cpu_level() if variant == "auto" else variant
    assert f"pagedkv: prebuilt kernels, variant {expected}:" in log, log[-3000:]
    assert log.count("prebuilt kernels, variant") == 1, log
    gemm_missing = "panel GEMM ops (AVX2 + FMA) are not loaded"
    if expected == "v2":
        assert "WARNING pagedkv.kernels: pagedkv: prebuilt kernels, variant v2:" in log, log[-3000:]
        assert "torch's GEMM, roughly 2x slower" in log and gemm_missing in log, log[-3000:]
    else:
        assert gemm_missing not in log, log[-3000:]
