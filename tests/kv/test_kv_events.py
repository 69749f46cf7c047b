"""KV cache events (vLLM's format): a router that replays them knows exactly which blocks the engine holds.

The events of a run with evictions, a reset and disk loads are replayed into a set of block hashes, which
must equal the pool's keys after every step; every BlockStored must hash back from its parent and token
ids to its own hashes. On the wire, batches decode with vLLM's own struct definitions (msgspec, copied from
vLLM's subscriber example) and arrive on a ZMQ SUB socket in sequence.
"""

from __future__ import annotations

import os
import random
import stat
import struct

import httpx
import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.openai_server import build_app
from pagedkv.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    as_wire,
    check_endpoint,
    packb,
)
from pagedkv.kv.hashing import hash_block
from tests.live_server import live_server, wait_idle
from tests.tiny_model import save_tiny_llama

PARAMS = SamplingParams(max_tokens=8, temperature=0)

try:
    import msgspec
except ImportError:  # the structs below are vLLM's decoder; without msgspec that test skips
    msgspec = None

if msgspec is not None:  # vLLM's structs, as its subscriber example copies them from vllm.distributed.kv_events

    class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list

    class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class VBlockStored(VKVCacheEvent, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None

    class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
        pass

    class VKVEventBatch(VEventBatch):
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(4, 512) for _ in range(70)]
    return [system + [rng.randrange(4, 512) for _ in range(rng.randrange(10, 50))] for _ in range(n)]


class Router:
    """What a KV-aware router keeps per replica: the set of block hashes, from the events alone."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.hashes: set[bytes] = set()
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.batches: list[KVEventBatch] = []

    def __call__(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)
        for event in batch.events:
            self.counts[type(event).__name__] += 1
            if isinstance(event, BlockStored):
                assert event.block_size == self.block_size and event.medium == "GPU"
                if event.token_ids:  # a salted request's blocks come without them
                    self._check_hashes(event)
                assert not self.hashes & set(event.block_hashes), "stored twice without a removal"
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.hashes, "removed a block never stored"
                self.hashes.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()

    def _check_hashes(self, event: BlockStored) -> None:
        """Each hash follows from its parent's and its tokens."""
        assert len(event.token_ids) == self.block_size * len(event.block_hashes)
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * self.block_size : (i + 1) * self.block_size]
            assert hash_block(parent, tokens) == block_hash
            parent = block_hash


def _pool_keys(llm: LLM) -> set[bytes]:
    pool = llm.engine.kv.pool
    return {k for k in (pool.key_of(b) for b in range(pool.num_blocks)) if k is not None}


def test_a_router_replaying_the_events_knows_every_cached_block(tiny, tmp_path):
    llm = LLM(model=tiny, num_kv_blocks=24, max_num_seqs=4, kv_cache_dir=str(tmp_path / "kv"))
    router = Router(16)
    llm.subscribe_kv_events(router)
    prompts = _prompts(seed=1, n=10)
    engine = llm.engine
    for prompt in prompts:  # one request at a time, checking after every step
        engine.add_request(prompt_token_ids=prompt, params=PARAMS)
        while engine.has_unfinished_requests():
            engine.step()
            assert router.hashes == _pool_keys(llm)
    assert router.counts["BlockStored"] and router.counts["BlockRemoved"]  # the small pool evicted

    assert llm.reset_prefix_cache()
    assert router.counts["AllBlocksCleared"] == 1 and router.hashes == _pool_keys(llm) == set()

    llm.engine.disk.flush()
    llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)  # a burst, some from disk
    assert llm.stats()["disk_blocks_loaded"] > 0
    assert router.hashes == _pool_keys(llm)


def test_unsubscribed_or_never_subscribed_gets_nothing(tiny):
    llm = LLM(model=tiny, num_kv_blocks=64)
    assert llm.engine.kv.events is None  # off by default: nothing is recorded
    seen: list[KVEventBatch] = []
    unsubscribe = llm.subscribe_kv_events(seen.append)
    llm.generate(prompt_token_ids=_prompts(seed=2, n=2), sampling_params=PARAMS, use_tqdm=False)
    assert seen and all(batch.events for batch in seen)
    unsubscribe()
    count = len(seen)
    llm.generate(prompt_token_ids=_prompts(seed=3, n=2), sampling_params=PARAMS, use_tqdm=False)
    assert len(seen) == count


def _sample_batch() -> KVEventBatch:
    a, b = hash_block(None, list(range(16))), hash_block(None, list(range(16, 32)))
    return KVEventBatch(
        1234.5,
        [BlockStored([a, b], None, list(range(32)), 16), BlockRemoved([a]), AllBlocksCleared()],
    )


def test_batches_decode_with_vllms_own_structs():
    if msgspec is None:
        pytest.skip("msgspec is not installed (vLLM's decoder)")
    batch = _sample_batch()
    decoded = msgspec.msgpack.Decoder(type=VKVEventBatch).decode(packb(as_wire(batch)))
    stored, removed, cleared = decoded.events
    assert decoded.ts == 1234.5
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (
        batch.events[0].block_hashes,
        None,
        list(range(32)),
    )
    assert (stored.block_size, stored.lora_id, stored.medium) == (16, None, "GPU")
    assert (removed.block_hashes, removed.medium) == (batch.events[1].block_hashes, "GPU")
    assert isinstance(cleared, VAllBlocksCleared)
    # and our encoder's bytes are the reference msgpack library's
    msgpack = pytest.importorskip("msgpack")
    assert msgpack.unpackb(packb(as_wire(batch))) == as_wire(batch)


def test_the_zmq_socket_publishes_each_steps_batch_in_sequence(tiny, tmp_path):
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    endpoint = f"ipc://{tmp_path}/kv-events"
    llm = LLM(model=tiny, num_kv_blocks=64, kv_events_endpoint=endpoint)
    seen: list[KVEventBatch] = []
    llm.subscribe_kv_events(seen.append)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    try:
        llm.engine.core.kv_events.publish([AllBlocksCleared()])  # until one arrives: PUB drops before a join
        for _ in range(50):
            try:
                sub.recv_multipart()
                break
            except zmq.Again:
                llm.engine.core.kv_events.publish([AllBlocksCleared()])
        seen.clear()
        llm.generate(prompt_token_ids=_prompts(seed=4, n=3), sampling_params=PARAMS, use_tqdm=False)
        frames = [sub.recv_multipart() for _ in seen]
    finally:
        sub.close()
        llm.engine.close()
    sequence = [struct.unpack(">q", seq)[0] for _, seq, _ in frames]
    assert sequence == list(range(sequence[0], sequence[0] + len(seen)))
    assert all(topic == b"" for topic, _, _ in frames)
    assert [msgpack.unpackb(payload) for _, _, payload in frames] == [as_wire(batch) for batch in seen]


# -- not a side channel (issue 25 row 10): who can connect, and what a salted request publishes -----------------

REFUSED_ENDPOINTS = [
    "tcp://0.0.0.0:5557",
    "tcp://*:5557",
    "tcp://[::]:5557",
    "tcp://192.0.2.1:5557",
    "tcp://example.com:5557",
    "tcp://lo;127.0.0.1:5557",  # ZMQ's source-address form: not checked, so refused
    "tcp://127.0.0.1",
    "ipc://@pagedkv-abstract",  # abstract sockets have no permissions
    "ipc://*",
    "pgm://eth0;239.192.1.1:5555",
    "inproc://kv",
]


@pytest.mark.parametrize("endpoint", REFUSED_ENDPOINTS)
def test_an_endpoint_others_can_reach_is_refused_naming_the_option(endpoint):
    with pytest.raises(ValueError, match="kv_events_allow_remote"):
        check_endpoint(endpoint, allow_remote=False)
    check_endpoint(endpoint, allow_remote=True)  # said explicitly: allowed


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://127.0.0.2:0", "tcp://localhost:0", "tcp://[::1]:0"])
def test_loopback_endpoints_bind(endpoint):
    pytest.importorskip("zmq")
    publisher = KVEventPublisher(endpoint)
    try:
        assert publisher.endpoint.startswith(("tcp://127.", "tcp://[::1]:"))
    finally:
        publisher.close()


def test_an_ipc_socket_is_owner_only_whatever_the_umask(tmp_path):
    pytest.importorskip("zmq")
    path = tmp_path / "kv-events"
    old = os.umask(0)  # a careless umask: the socket would be mode 0777
    try:
        publisher = KVEventPublisher(f"ipc://{path}")
    finally:
        os.umask(old)
    try:
        info = path.lstat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    finally:
        publisher.close()


def test_an_ipc_socket_in_a_directory_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # others could swap the socket file
    with pytest.raises(ValueError, match=r"others can write .*kv_events_allow_remote"):
        check_endpoint(f"ipc://{shared}/kv-events", allow_remote=False)
    shared.chmod(0o1777)  # sticky, like /tmp: others cannot remove or replace our file
    check_endpoint(f"ipc://{shared}/kv-events", allow_remote=False)


def test_a_refused_endpoint_fails_before_the_model_loads(tiny, monkeypatch):
    def load_model(*_, **__):
        raise AssertionError("the model loaded before the endpoint was checked")

    monkeypatch.setattr("pagedkv.engine.builder.load_model", load_model)
    with pytest.raises(ValueError, match="kv_events_allow_remote"):
        LLM(model=tiny, kv_events_endpoint="tcp://0.0.0.0:0")


def test_a_salted_requests_events_carry_hashes_but_no_token_ids(tiny):
    llm = LLM(model=tiny, num_kv_blocks=64)
    router = Router(16)
    seen: list[KVEventBatch] = []
    llm.subscribe_kv_events(seen.append)
    llm.subscribe_kv_events(router)
    prompt = _prompts(seed=5, n=1)
    llm.generate(prompt_token_ids=prompt, sampling_params=PARAMS, use_tqdm=False, cache_salt="tenant-a")
    salted = [e for b in seen for e in b.events if isinstance(e, BlockStored)]
    assert salted and all(e.block_hashes and e.token_ids == [] for e in salted)
    assert router.hashes == _pool_keys(llm)  # a router still knows every block, salted ones too
    seen.clear()
    llm.generate(prompt_token_ids=prompt, sampling_params=PARAMS, use_tqdm=False)  # the same prompt, unsalted
    plain = [e for b in seen for e in b.events if isinstance(e, BlockStored)]
    assert plain and all(len(e.token_ids) == 16 * len(e.block_hashes) for e in plain)
    assert not {h for e in plain for h in e.block_hashes} & {h for e in salted for h in e.block_hashes}


def test_a_live_server_publishes_no_salted_prompt(tiny, tmp_path):
    """Against a real server on loopback: a subscriber on the owner-only IPC socket sees a salted request's
    block hashes but none of its token ids, an unsalted one's tokens as before, and no block stays held."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    endpoint = f"ipc://{tmp_path}/kv-events"
    engine = LLMEngine(EngineConfig(model=tiny, num_kv_blocks=64, num_threads=1, kv_events_endpoint=endpoint))
    assert stat.S_IMODE(os.lstat(tmp_path / "kv-events").st_mode) == 0o600
    app = build_app(engine, "tiny")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 300)
    sub.connect(endpoint)
    salted, plain = _prompts(seed=6, n=2)
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    stored: dict[str, list] = {"salted": [], "plain": []}
    try:
        with live_server(app) as url:
            for _ in range(50):  # a PUB socket drops what is sent before the SUB has joined
                engine.kv_events.publish([AllBlocksCleared()])
                try:
                    sub.recv_multipart()
                    break
                except zmq.Again:
                    pass
            for name, prompt, salt in (("salted", salted, "tenant-a"), ("plain", plain, None)):
                resp = httpx.post(f"{url}/v1/completions", json=body | {"prompt": prompt, "cache_salt": salt})
                assert resp.status_code == 200, resp.text
                while True:  # this request's batches, until the socket is quiet
                    try:
                        _, _, payload = sub.recv_multipart()
                    except zmq.Again:
                        break
                    stored[name] += [e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
            stats = wait_idle(app)
    finally:
        sub.close()
        engine.close()
    # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    assert stored["salted"] and all(e[1] and e[3] == [] for e in stored["salted"])
    assert stored["plain"] and all(len(e[3]) == 16 * len(e[1]) for e in stored["plain"])
    first = next(e for e in stored["plain"] if e[2] is None)
    assert first[3] == plain[: len(first[3])]
    assert stats["kv_blocks_used"] == 0
