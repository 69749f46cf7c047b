"""A victim for the hostile-client tests: a greedy chat stream whose pace and text an attack must not disturb.

Issue 25's target for every attack: the victim's largest gap between two stream events stays within 3x its
median gap + 0.5 s, and its text is exactly its greedy text alone.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx

from pagedkv import SamplingParams
from pagedkv.engine.engine import LLMEngine

CHAT = "/v1/chat/completions"


def greedy_text(engine: LLMEngine, messages: list[dict], max_tokens: int) -> str:
    """The victim's text alone on ``engine`` (before any server runs on it): the reference it must match."""
    request_id = engine.add_request(
        prompt_token_ids=engine.apply_chat_template(messages),
        params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    text = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id == request_id:
                text = output.text
    assert text is not None
    return text


class VictimStream(threading.Thread):
    """A greedy chat stream that notes when each event arrives and what text it got; ``decoding`` is set once
    a few tokens came, so that an attack starts on its decode steps, not on its prefill."""

    def __init__(self, base_url: str, messages: list[dict], max_tokens: int) -> None:
        super().__init__()
        self.base_url, self.messages, self.max_tokens = base_url, messages, max_tokens
        self.times: list[float] = []
        self.text: list[str] = []
        self.stream_id: str | None = None  # the response's id: the engine's request id
        self.decoding = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"messages": self.messages, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        try:
            with httpx.stream("POST", self.base_url + CHAT, json=body | {"stream": True}, timeout=120) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.times.append(time.monotonic())
                        chunk = json.loads(line.removeprefix("data: "))
                        self.stream_id = chunk["id"]
                        for choice in chunk["choices"]:
                            self.text.append(choice["delta"].get("content") or "")
                        if len(self.times) == 4:
                            self.decoding.set()
        except BaseException as exc:  # noqa: BLE001 - reported by gaps()
            self.error = exc
        self.decoding.set()

    def got_more(self, count: int, timeout_s: float = 30.0) -> bool:
        """Whether ``count`` more events arrive (counted from now) while the caller waits: called from hostile
        work made to wait for them, it says whether the stream moves on while that work is in progress.
        ``timeout_s`` only ends a wait for a stream that stalled; a slow machine makes the wait longer, not false."""
        target = len(self.times) + count
        deadline = time.monotonic() + timeout_s
        while len(self.times) < target and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        return len(self.times) >= target

    def gaps(self) -> list[float]:
        """The gaps between its events, once the stream finished (it must have, with most of its tokens)."""
        self.join(120)
        assert self.error is None and not self.is_alive()
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        assert len(gaps) > self.max_tokens // 2
        return gaps

    def largest_and_median_gap(self) -> tuple[float, float]:
        gaps = self.gaps()
        return max(gaps), statistics.median(gaps)

    def check_pace(self) -> None:
        """Issue 25's target: the largest gap within 3x the median + 0.5 s."""
        largest, median = self.largest_and_median_gap()
        assert largest <= 3 * median + 0.5, f"largest gap {largest:.2f} s, median {median:.3f} s"
