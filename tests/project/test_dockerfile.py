"""The Dockerfile: its torch is the one the wheel's kernels need, it runs as a user, and (where a container
daemon answers and PAGEDKV_TEST_DOCKER=1) the image it builds serves /health.

The build needs the network (PyPI, PyTorch's CPU index) and a wheel in dist/ (`make wheel`), so it is opt-in,
as the Ray and browser tests are; the checks of the file itself run everywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions(name: str) -> list[str]:
    """The arguments of every ``name`` instruction, continuation lines joined."""
    lines = DOCKERFILE.replace("\\\n", " ").splitlines()
    return [line.split(None, 1)[1] for line in lines if line.startswith(name + " ")]


def test_the_image_pins_the_torch_the_kernels_were_built_against():
    """The wheel requires its build's torch (setup.py); an image with another would not install it."""
    (pin,) = [arg.split("=", 1)[1] for arg in _instructions("ARG") if arg.startswith("TORCH_VERSION=")]
    assert pin == torch.__version__.split("+")[0]


def test_the_image_runs_as_a_user_and_checks_health():
    users = _instructions("USER")
    assert users and users[-1] not in ("root", "0")
    (health,) = _instructions("HEALTHCHECK")
    assert "/health" in health
    (entry,) = _instructions("ENTRYPOINT")
    assert re.search(r'"pagedkv", "serve"', entry) and "0.0.0.0" in entry


def _container_tool() -> str | None:
    for tool in ("docker", "podman"):
        if shutil.which(tool) and subprocess.run([tool, "info"], capture_output=True, timeout=30).returncode == 0:
            return tool
    return None


@pytest.mark.slow
def test_the_image_builds_and_serves(tmp_path):
    tool = _container_tool()  # asked first: where no daemon answers, that is why it skips, whatever is set
    if tool is None:
        pytest.skip("no container daemon answers here (docker info / podman info failed)")
    if os.environ.get("PAGEDKV_TEST_DOCKER") != "1":
        pytest.skip("builds an image from the network (PyPI, PyTorch's CPU index): PAGEDKV_TEST_DOCKER=1 runs it")
    if not list((ROOT / "dist").glob("pagedkv-*.whl")):
        pytest.skip("no wheel in dist/: `make wheel` first")
    tag = "pagedkv-test:latest"
    subprocess.run([tool, "build", "-t", tag, str(ROOT)], check=True, timeout=1800)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"pagedkv-test-{port}"
    subprocess.run([tool, "run", "-d", "--rm", "--name", name, "-p", f"127.0.0.1:{port}:8000", tag], check=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the container did not answer /health in 300 s"
                time.sleep(2)
    finally:
        subprocess.run([tool, "stop", name], capture_output=True, timeout=60)
