"""``pagedkv serve --replicas 2`` on a local Ray cluster (127.0.0.1 only), each configuration in its own
process: prefix-aware routing keeps one cold prefill per prefix where a random router does not, the
official ``openai`` client works through Ray's HTTP proxy, ``cache_salt`` still isolates tenants, nothing
but loopback listens, a killed replica fails no later request and is replaced, SIGTERM tears it all down.

A tiny random model with a word-level tokenizer: prompts are token ids, so block counts are exact.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.tiny_model import save_tiny_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="Ray Serve is not installed: pip install -e '.[ray]' (or make test-ray) to run these tests",
    ),
]

BLOCK, PREFIX_BLOCKS, SUFFIX = 16, 5, 8
PREFIX = BLOCK * PREFIX_BLOCKS
START_TIMEOUT_S, STOP_TIMEOUT_S = 240, 90
ENGINE_REPLICA = "ray::ServeReplica:pagedkv:PagedKVEngine"


@dataclass
class Served:
    """One answered completion: which replica, and how much of its prompt came from the prefix cache."""

    group: int
    replica: str
    prompt_tokens: int
    cached_tokens: int

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class RayServer:
    """``pagedkv serve --replicas 2`` in a new session (so its whole process tree is findable and ends)."""

    def __init__(self, model: Path, log: Path, router: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "pagedkv.entrypoints.cli", "serve", "--replicas", "2", "--router", router]
        command += ["--model", str(model), "--served-model-name", "tiny", "--port", str(self.port)]
        command += ["--block-size", str(BLOCK), "--num-kv-blocks", "2048", "--max-num-seqs", "8"]
        command += ["--replica-cpus", "0.9"]  # a fraction of a core each: the engine still runs one thread
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "serving on http://" not in log.read_text(errors="replace"):
            assert self.process.poll() is None, f"the server exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"not serving after {START_TIMEOUT_S} s:\n{self.tail()}"
            time.sleep(0.5)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process of the server's session."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) == self.process.pid:
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except (OSError, ProcessLookupError):
                continue
        return {pid: cmd for pid, cmd in found.items() if cmd}  # zombies have no command line

    def stop(self) -> int:
        """SIGTERM, as a supervisor sends it; SIGKILL to the session only if that did not work in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
            raise


@contextmanager
def ray_server(model: Path, log: Path, router: str) -> Iterator[RayServer]:
    server = RayServer(model, log, router)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("ray") / "tiny")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory) -> Iterator[RayServer]:
    with ray_server(model, tmp_path_factory.mktemp("logs") / "block-keys.log", "block-keys") as running:
        yield running


def complete(url: str, prompt: list[int], group: int = -1, **extra) -> Served:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return Served(group, response.headers["x-pagedkv-replica"], usage["prompt_tokens"], cached)


def shared_prefix_workload(seed: int, groups: int = 4, per_group: int = 5) -> list[list[list[int]]]:
    """``groups`` prefixes of PREFIX_BLOCKS full blocks, each followed by ``per_group`` distinct suffixes."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(10, 500) for _ in range(PREFIX)]
        prompts.append([prefix + [rng.randrange(10, 500) for _ in range(SUFFIX)] for _ in range(per_group)])
    return prompts


def run_workload(url: str, workload: list[list[list[int]]]) -> list[Served]:
    """Each group's first request alone (its cold prefill), then all the others, four at a time, interleaved."""
    served = [complete(url, group[0], g) for g, group in enumerate(workload)]
    rest = [(g, group[i]) for i in range(1, len(workload[0])) for g, group in enumerate(workload)]
    with ThreadPoolExecutor(4) as pool:
        served += pool.map(lambda item: complete(url, item[1], item[0]), rest)
    return served


def test_requests_sharing_a_prefix_land_on_one_replica_and_prefill_it_once(server):
    workload = shared_prefix_workload(seed=1)
    served = run_workload(server.url, workload)
    first = {s.group: s.replica for s in served[: len(workload)]}
    assert all(s.replica == first[s.group] for s in served), [(s.group, s.replica) for s in served]
    assert len(set(first.values())) == 2, "new prefixes should spread over both replicas"
    assert [s.cached_tokens for s in served[: len(workload)]] == [0] * len(workload)
    assert all(s.cached_tokens == PREFIX for s in served[len(workload) :])
    cold = len(workload) * (PREFIX + SUFFIX)
    assert sum(s.computed for s in served) == cold + (len(served) - len(workload)) * SUFFIX


def test_a_random_router_prefills_shared_prefixes_more_often(server, model, tmp_path):
    workload = shared_prefix_workload(seed=2)
    affine = sum(s.computed for s in run_workload(server.url, workload))
    with ray_server(model, tmp_path / "random.log", "random") as random_server:
        randomly = sum(s.computed for s in run_workload(random_server.url, workload))
    # 4 prefixes x 4 follow-ups on 2 replicas: a random router misses each prefix's replica at least once
    # with probability 15/16 per prefix, and each miss prefills the 80-token prefix again.
    assert randomly >= affine + PREFIX, (affine, randomly)


def test_the_openai_client_works_through_the_ray_http_proxy(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    prompt = list(range(20, 60))
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, stream=True))
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answer.choices[0].text
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=-1)


def test_a_cache_salt_still_isolates_tenants(server):
    prompt = [random.Random(3).randrange(10, 500) for _ in range(PREFIX + SUFFIX)]
    assert complete(server.url, prompt, cache_salt="tenant-a").cached_tokens == 0
    assert complete(server.url, prompt, cache_salt="tenant-a").cached_tokens == PREFIX
    assert complete(server.url, prompt, cache_salt="tenant-b").cached_tokens == 0
    assert complete(server.url, prompt).cached_tokens == 0


def test_a_replica_takes_max_num_seqs_requests_at_once_and_the_other_takes_the_rest(server):
    prompt = shared_prefix_workload(seed=7, groups=1, per_group=1)[0][0]
    holder = complete(server.url, prompt).replica
    with ThreadPoolExecutor(12) as pool:  # long answers (seconds): all 12 are routed before any finishes
        served = list(pool.map(lambda _: complete(server.url, prompt, max_tokens=2000, ignore_eos=True), range(12)))
    # the prefix's replica takes max_num_seqs (8; Ray's default cap would be 5), then the other replica
    assert sorted(sum(s.replica == r for s in served) for r in {s.replica for s in served}) == [4, 8]
    assert sum(s.replica == holder for s in served) == 8


def test_replicas_run_the_thread_count_they_were_given(server):
    replicas = [pid for pid, cmd in server.processes().items() if cmd.startswith(ENGINE_REPLICA)]
    assert len(replicas) == 2
    for pid in replicas:
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        assert environ["OMP_NUM_THREADS"] == "1"
    assert "2 replicas (0.90 CPUs, 1 threads each, router block-keys)" in server.log.read_text()


def _aborted(url: str) -> dict[str, float]:
    """Each replica's count of aborted requests, from its /metrics (GETs go to a least-loaded replica)."""
    seen: dict[str, float] = {}
    for _ in range(20):
        response = httpx.get(f"{url}/metrics", timeout=30)
        line = next(
            (x for x in response.text.splitlines() if x.startswith('pagedkv:requests_total{finish_reason="abort"}')), ""
        )
        seen[response.headers["x-pagedkv-replica"]] = float(line.split()[-1]) if line else 0.0
        if len(seen) == 2:
            break
    return seen


def test_a_client_that_disconnects_aborts_its_request_on_the_replica(server):
    before = _aborted(server.url)
    body = {"model": "tiny", "prompt": list(range(40, 140)), "max_tokens": 3900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        replica = response.headers["x-pagedkv-replica"]
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generating; then the client leaves
    deadline = time.monotonic() + 30
    while _aborted(server.url).get(replica, 0) < before.get(replica, 0) + 1:
        assert time.monotonic() < deadline, "the replica did not abort the request of a client that left"
        time.sleep(0.5)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    """inode -> (local address in hex as /proc/net shows it, port) of every listening TCP socket."""
    sockets = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].split(":")
                sockets[int(fields[9])] = (address, int(port, 16))
    return sockets


def _is_loopback(address: str) -> bool:
    if len(address) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return address.endswith("7F")
    return address == "00000000000000000000000001000000" or address.startswith("0000000000000000FFFF0000")


def test_nothing_but_loopback_listens_besides_rays_replica_transport(server):
    listening = _listening_inodes()
    commands = server.processes()
    by_process: dict[int, list[tuple[str, int]]] = {}
    for pid in commands:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in listening:
                by_process.setdefault(pid, []).append(listening[int(target[8:-1])])
    http = [(a, p) for sockets in by_process.values() for a, p in sockets if p == server.port]
    assert http and all(_is_loopback(a) and len(a) == 8 for a, _ in http), http  # the proxy: 127.0.0.1 only
    for pid, sockets in by_process.items():
        wide = [(a, p) for a, p in sockets if not _is_loopback(a)]
        # Ray Serve 2.60 binds each replica's inter-deployment gRPC server to [::]:0 (hard-coded; Ray's
        # token authentication guards it): one per replica process, nothing anywhere else.
        allowed = 1 if commands.get(pid, "").startswith("ray::ServeReplica") else 0
        assert len(wide) <= allowed, (commands.get(pid), sockets)


def _cpu_ticks(pids: list[int]) -> dict[int, int]:
    ticks = {}
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


def test_a_replica_killed_mid_request_fails_no_request_and_is_replaced(server):
    replicas = [pid for pid, cmd in server.processes().items() if cmd.startswith(ENGINE_REPLICA)]
    assert len(replicas) == 2, server.processes()
    prompt = shared_prefix_workload(seed=4, groups=1, per_group=1)[0][0]
    holder = complete(server.url, prompt).replica
    with ThreadPoolExecutor(1) as pool:  # a long answer on the replica that holds the prefix
        long = pool.submit(complete, server.url, prompt, max_tokens=3900, ignore_eos=True)
        time.sleep(1.0)
        before = _cpu_ticks(replicas)
        time.sleep(0.5)
        after = _cpu_ticks(replicas)
        victim = max(replicas, key=lambda pid: after[pid] - before[pid])  # the one generating
        assert not long.done(), "the long request ended before the replica could be killed"
        os.kill(victim, signal.SIGKILL)
        retried = long.result()
    # it died before answering, so the ingress ran the request again on the other replica
    assert retried.replica != holder and retried.prompt_tokens == len(prompt)
    seen = {holder, retried.replica}
    for group in shared_prefix_workload(seed=5, groups=6, per_group=1):
        seen.add(complete(server.url, group[0]).replica)  # each must succeed: a 5xx fails the test here
    deadline = time.monotonic() + 120
    seed = 6
    while len(seen) < 3:  # the replacement shows up: cold prompts go to the replica holding the fewest blocks
        assert time.monotonic() < deadline, f"no replacement replica answered; saw {seen}\n{server.tail()}"
        seen.add(complete(server.url, shared_prefix_workload(seed=seed, groups=1, per_group=1)[0][0]).replica)
        seed += 1
        time.sleep(1)
    alive = [pid for pid, cmd in server.processes().items() if cmd.startswith(ENGINE_REPLICA)]
    assert victim not in alive and len(alive) == 2


def test_sigterm_tears_the_whole_cluster_down(server):
    assert server.processes()
    assert server.stop() == 0, server.tail()
    assert server.processes() == {}
