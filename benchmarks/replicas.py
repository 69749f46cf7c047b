"""Replicas on Ray Serve: which router keeps more prefix-cache hits, and what running on Ray costs.

    python benchmarks/replicas.py routing [--routers block-keys,ray-prefix,pow2,random] [--json]
    python benchmarks/replicas.py costs [--model PATH] [--rounds R] [--json]

``routing`` serves a tiny random model (word-level tokenizer: one word, one token) with
``pagedkv serve --replicas 2 --router R``, a fresh cluster per router, and sends the same three workloads to
each in a shuffled order -- one request at a time (placement alone decides the hits) and 8 at a time (a
request may also come before the blocks it shares are computed) -- and reports the prompt tokens the
replicas' prefix caches served (``usage.prompt_tokens_details.cached_tokens``):

- chat: 6 system prompts of 12 blocks, 6 users each asking a 1-block question;
- multi-turn: each of those conversations goes on for 2 more turns (the whole previous prompt, an answer
  and a new question);
- documents: 4 system prompts of 2 blocks, each before 6 distinct 30-block documents -- the shared part is
  6 % of the text.

``costs`` compares, on the real model, ``pagedkv serve`` (one process, 2 threads) with
``pagedkv serve --replicas 2`` (two 1-thread replicas): start-up time, memory of the whole process tree (PSS),
one short request's latency, and 32 concurrent chat requests (``workloads/chat_shared_prefix.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import format_table  # noqa: E402

from tests.tiny_model import save_tiny_llama  # noqa: E402

BLOCK = 16
CONCURRENCY = (1, 8)  # one at a time: placement alone decides the hits; 8: as a loaded server sees them
START_TIMEOUT_S = 600


class Server:
    """``pagedkv serve`` in its own session; ``ready_s`` is the time until it answered."""

    def __init__(self, args: list[str], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--port", str(self.port), *args]
        started = time.monotonic()
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while not self._serving(log):
            if self.process.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                raise RuntimeError(f"the server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.25)
        self.ready_s = time.monotonic() - started

    def _serving(self, log: Path) -> bool:
        if "--replicas" in self.process.args:
            return "serving on http://" in log.read_text(errors="replace")
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def pss_mib(self) -> float:
        """Proportional set size of every process of the server's session: shared pages counted once."""
        total_kib = 0
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.getsid(int(entry.name)) == self.process.pid:
                    rollup = (entry / "smaps_rollup").read_text().splitlines()
                    total_kib += next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
            except (OSError, ProcessLookupError, StopIteration):
                continue
        return total_kib / 1024

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def words(rng: random.Random, n: int) -> list[str]:
    return [f"w{rng.randrange(10, 500)}" for _ in range(n)]


def routing_workloads(seed: int = 0) -> list[tuple[str, list[list[str]]]]:
    """(name, rounds of prompts): a round is sent after the previous one finished."""
    rng = random.Random(seed)
    systems = [words(rng, 12 * BLOCK) for _ in range(6)]
    chats = [system + words(rng, BLOCK) for system in systems for _ in range(6)]
    turns, conversations = [], chats
    for _ in range(2):
        conversations = [c + words(rng, 8) + words(rng, BLOCK) for c in conversations]
        turns.append(conversations)
    short_systems = [words(rng, 2 * BLOCK) for _ in range(4)]
    documents = [system + words(rng, 30 * BLOCK) for system in short_systems for _ in range(6)]
    rounds = [("chat", [chats]), ("multi-turn", turns), ("documents", [documents])]
    return [(name, [[" ".join(p) for p in prompts] for prompts in phase]) for name, phase in rounds]


def send(url: str, prompt: str, max_tokens: int = 1, **extra) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    usage = response.json()["usage"]
    return {
        "replica": response.headers.get("x-pagedkv-replica"),
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "seconds": time.perf_counter() - started,
    }


def run_rounds(url: str, rounds: list[list[str]], seed: int, concurrency: int) -> list[dict]:
    rng, results = random.Random(seed), []
    with ThreadPoolExecutor(concurrency) as pool:
        for prompts in rounds:
            order = rng.sample(prompts, len(prompts))
            results += pool.map(lambda p: send(url, p), order)
    return results


def bench_routing(routers: list[str], workdir: Path) -> dict:
    """router -> "workload, N at a time" -> counts. Each concurrency gets its own prompts (another seed),
    so the second finds nothing of the first in the caches."""
    model = save_tiny_llama(workdir / "tiny")
    summary: dict = {}
    for router in routers:
        server = Server(
            ["--replicas", "2", "--router", router, "--model", str(model), "--served-model-name", "m"]
            + ["--num-kv-blocks", "8192", "--max-num-seqs", "16"],
            workdir / f"{router}.log",
        )
        try:
            summary[router] = {}
            for concurrency in CONCURRENCY:
                for index, (name, rounds) in enumerate(routing_workloads(seed=concurrency)):
                    results = run_rounds(server.url, rounds, index, concurrency)
                    prompt, cached = sum(r["prompt"] for r in results), sum(r["cached"] for r in results)
                    replicas = {r["replica"] for r in results}
                    summary[router][f"{name}, {concurrency} at a time"] = {
                        "requests": len(results),
                        "prompt_tokens": prompt,
                        "cached_tokens": cached,
                        "hit_rate": cached / prompt,
                        "requests_per_replica": sorted(sum(r["replica"] == x for r in results) for x in replicas),
                        "median_latency_ms": 1000 * statistics.median(r["seconds"] for r in results),
                    }
        finally:
            server.stop()
    return summary


def chat_requests(limit: int = 32) -> list[dict]:
    workload = json.loads((ROOT / "workloads" / "chat_shared_prefix.json").read_text())
    system, questions = workload["system"], workload["questions"]
    return [
        {
            "model": "m",
            "max_tokens": 32,
            "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
        }
        for q in questions[:limit]
    ]


def measure_costs(args: list[str], log: Path, requests: list[dict]) -> dict:
    server = Server([*args, "--served-model-name", "m"], log)
    try:
        short = [send(server.url, "The capital of France is", max_tokens=1)["seconds"] for _ in range(12)][2:]
        started = time.perf_counter()
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(
                pool.map(lambda b: httpx.post(f"{server.url}/v1/chat/completions", json=b, timeout=600), requests)
            )
        elapsed = time.perf_counter() - started
        tokens = sum(a.json()["usage"]["completion_tokens"] for a in answers)
        return {
            "ready_s": server.ready_s,
            "pss_mib": server.pss_mib(),
            "short_request_ms": 1000 * statistics.median(short),
            "chat_tokens_per_s": tokens / elapsed,
            "chat_seconds": elapsed,
        }
    finally:
        server.stop()


BEST = {"ready_s": min, "pss_mib": min, "short_request_ms": min, "chat_tokens_per_s": max, "chat_seconds": min}


def bench_costs(model: str | None, workdir: Path, rounds: int) -> dict:
    """The two setups in alternation, ``rounds`` times each; the best of each measure (a shared machine's
    load only ever makes a run slower)."""
    requests = chat_requests()
    common = ["--model", model] if model else []
    setups = {
        "one process, 2 threads": [*common, "--threads", "2"],
        "2 replicas x 1 thread": [*common, "--replicas", "2"],
    }
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    for index in range(rounds):
        for name, args in setups.items():
            runs[name].append(measure_costs(args, workdir / f"{index}-{len(runs[name])}.log", requests))
    return {name: {key: BEST[key](r[key] for r in results) for key in BEST} for name, results in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("routing", "costs"))
    parser.add_argument("--routers", default="block-keys,ray-prefix,pow2,random")
    parser.add_argument("--model", default=None, help="costs: the model to serve (default: the default model)")
    parser.add_argument("--rounds", type=int, default=2, help="costs: runs of each setup, in alternation")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedkv-replicas-") as tmp:
        if args.part == "routing":
            summary = bench_routing(args.routers.split(","), Path(tmp))
            rows = [
                [
                    router,
                    name,
                    f"{r['cached_tokens']}/{r['prompt_tokens']}",
                    f"{100 * r['hit_rate']:.1f} %",
                    str(r["requests_per_replica"]),
                    f"{r['median_latency_ms']:.0f}",
                ]
                for router, phases in summary.items()
                for name, r in phases.items()
            ]
            headers = ["router", "workload", "cached/prompt tokens", "hit rate", "requests per replica", "p50 ms"]
        else:
            summary = bench_costs(args.model, Path(tmp), args.rounds)
            rows = [
                [
                    name,
                    f"{r['ready_s']:.1f}",
                    f"{r['pss_mib']:.0f}",
                    f"{r['short_request_ms']:.0f}",
                    f"{r['chat_tokens_per_s']:.0f}",
                ]
                for name, r in summary.items()
            ]
            headers = ["setup", "ready s", "memory (PSS) MiB", "1-token request ms", "32 chats tok/s"]
    print(json.dumps(summary, indent=2) if args.json else format_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
