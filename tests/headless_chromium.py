"""Drive a real headless Chromium from a test, over the DevTools protocol on a pipe (no extra package).

``--remote-debugging-pipe`` makes Chromium read protocol commands from fd 3 and write replies to fd 4,
each a JSON message ended by a NUL byte. This is enough to open a page, evaluate JavaScript in it and
take screenshots; every wait is bounded, and the browser is killed when the block ends.
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class Page:
    """One browser tab: ``call`` a protocol method, ``evaluate`` JavaScript, take a ``screenshot``."""

    def __init__(self, process: subprocess.Popen, to_browser: int, from_browser: int, timeout_s: float) -> None:
        self._process, self._out, self._in, self.timeout_s = process, to_browser, from_browser, timeout_s
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    def call(self, method: str, session: bool = True, **params: Any) -> dict:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session and self.session is not None:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise TimeoutError(f"Chromium did not answer in time (exit code {self._process.poll()})")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str, width: int, height: int) -> None:
        target = self.call("Target.createTarget", session=False, url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", session=False, targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Evaluate ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied {expression!r}")
            time.sleep(0.1)

    def screenshot(self) -> np.ndarray:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


_SHIM = (
    "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); os.execv(sys.argv[3], sys.argv[3:])"
)


def _high_pipe() -> tuple[int, int]:
    """A pipe on fds above 9, so putting one end on fd 3 or 4 can never overwrite the other."""
    ends = os.pipe()
    high = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in ends)
    for fd in ends:
        os.close(fd)
    return high


@contextmanager
def chromium(binary: str, profile_dir: Path, timeout_s: float = 30.0) -> Iterator[Page]:
    to_browser_r, to_browser_w = _high_pipe()
    from_browser_r, from_browser_w = _high_pipe()
    args = [
        "--headless",
        "--remote-debugging-pipe",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={profile_dir}",
    ]
    if os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium refuses to run its sandbox as root
    profile_dir.mkdir(parents=True, exist_ok=True)
    log = open(profile_dir / "chromium.log", "wb")  # noqa: SIM115 (closed with the browser)
    # fds 3 and 4 are where Chromium looks for the pipe; a small Python shim puts ours there (dash, the
    # usual /bin/sh, cannot name fds above 9 in a redirection).
    command = [sys.executable, "-c", _SHIM, str(to_browser_r), str(from_browser_w), binary, *args]
    process = subprocess.Popen(
        command,
        pass_fds=(to_browser_r, from_browser_w),
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,  # its own process group: the renderers go with it
    )
    os.close(to_browser_r)
    os.close(from_browser_w)
    page = Page(process, to_browser_w, from_browser_r, timeout_s)
    try:
        yield page
    finally:
        try:
            page.timeout_s = 5.0
            page.call("Browser.close", session=False)
            process.wait(10)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            pass
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        os.close(to_browser_w)
        os.close(from_browser_r)
        log.close()
