"""KV cache events (vLLM's format): a router that replays them knows exactly which blocks the engine holds.

The events of a run with evictions, a reset and disk loads are replayed into a set of block hashes, which
must equal the pool's keys after every step; every BlockStored must hash back from its parent and token
ids to its own hashes. On the wire, batches decode with vLLM's own struct definitions (msgspec, copied from
vLLM's subscriber example) and arrive on a ZMQ SUB socket in sequence.
"""

from __future__ import annotations

import random
import struct

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, as_wire, packb
from pagedkv.kv.hashing import hash_block
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
                assert len(event.token_ids) == self.block_size * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):  # each hash follows from parent + tokens
                    tokens = event.token_ids[i * self.block_size : (i + 1) * self.block_size]
                    assert hash_block(parent, tokens) == block_hash
                    parent = block_hash
                assert not self.hashes & set(event.block_hashes), "stored twice without a removal"
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.hashes, "removed a block never stored"
                self.hashes.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()


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
