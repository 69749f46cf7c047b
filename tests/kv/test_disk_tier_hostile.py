"""The disk tier hurts no one (issue 25, rows 8, 9 and 12): whatever is found in ``kv_cache_dir`` -- random
bytes, deeply nested or oversized headers, huge declared shapes, FIFOs, devices, symlinks, directories under a
block's name, foreign files, a planted lock file -- a request never fails, never hangs, gets the bits of a run
without the disk tier, and no file the tier did not write is lost; no KV block leaks.

Every test has a time limit (a FIFO opened for reading blocks forever); the whole file runs in ~15 s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.kv.block_directory import BLOCKS_DIR, LOCK_FILE
from pagedkv.kv.disk_files import FORMAT, MAX_HEADER
from pagedkv.kv.disk_tier import DiskTier
from pagedkv.kv.hashing import extend_block_keys
from tests.tiny_model import save_tiny_llama

GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
TIER_LOGGERS = ("pagedkv.kv.disk_tier", "pagedkv.kv.disk_files", "pagedkv.kv.block_directory")
BLOCK_FILE = 2 * 2 * 16 * 2 * 64 * 4 + 400  # the tiny model's block file: K and V, 2 layers, fp32, + header


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Five prompts behind one shared 64-token system prompt, each with its own tail of full blocks."""
    rng = random.Random(25)
    system = [rng.randrange(4, 512) for _ in range(64)]
    return [system + [rng.randrange(4, 512) for _ in range(rng.randrange(30, 60))] for _ in range(5)]


@pytest.fixture(scope="module")
def reference(tiny, prompts) -> list[tuple]:
    """The outputs of an engine without the disk tier."""
    return _run(LLM(model=tiny, num_kv_blocks=128, enable_prefix_caching=False), prompts)


def _run(llm: LLM, prompts) -> list[tuple]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _keys(prompt: list[int]) -> list[bytes]:
    keys: list[bytes] = []
    extend_block_keys(keys, prompt, 16)
    return keys


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name in TIER_LOGGERS and r.levelno >= logging.WARNING]


def _digests(paths: list[Path]) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


# -- what may lie under a block's name ------------------------------------------------------------------------


def _header_file(header: object, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def _hostile_bytes(rng: random.Random, fingerprint: str, key: bytes) -> bytes:
    """A regular file's worth of trouble: random bytes, deep nesting, or lies in an otherwise right header."""
    depth = rng.randrange(2_000, MAX_HEADER // 2)
    meta = {"format": FORMAT, "fingerprint": fingerprint, "key": key.hex(), "sha256": "0" * 64}
    choices = [
        lambda: rng.randbytes(rng.randrange(0, 4 * BLOCK_FILE)),
        lambda: _header_file(b"[" * depth + b"]" * depth),
        lambda: _header_file(b'{"a":' * (depth // 5) + b"1" + b"}" * (depth // 5)),
        lambda: (2**63).to_bytes(8, "little") + b"{}",
        lambda: _header_file(
            {"__metadata__": meta, "kv": {"dtype": "F32", "shape": [10**12] * 5, "data_offsets": [0, 10**60]}}
        ),
        lambda: _header_file(
            {"__metadata__": meta, "kv": {"dtype": "F32", "shape": [2, 2, 16, 2, 64], "data_offsets": [-64, 32704]}},
            bytes(32768),
        ),
        lambda: _header_file(
            {"__metadata__": meta, "kv": {"dtype": "F32", "shape": ["9" * 5000], "data_offsets": ["9" * 5000, 0]}}
        ),
        lambda: _header_file([meta] * 3),
        lambda: _header_file(b'"' + b"\\" * 1000),
    ]
    return rng.choice(choices)()


def _plant(path: Path, kind: str, rng: random.Random, fingerprint: str, key: bytes, outside: Path) -> None:
    """Put ``kind`` of trouble under a block file's name."""
    path.unlink(missing_ok=True)
    if kind == "bytes":
        path.write_bytes(_hostile_bytes(rng, fingerprint, key))
    elif kind == "oversized":  # sparse: far more than a block, without the disk space
        with open(path, "wb") as f:
            f.truncate(1 << 30)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            os.symlink("/dev/zero", path)
    elif kind == "symlink":
        os.symlink(outside / "precious.bin", path)
    else:
        path.mkdir()


# -- one tier, no engine ---------------------------------------------------------------------------------------


def _small_tier(root: Path, max_files: int) -> DiskTier:
    """A tier of 2 layers of [4, 2, 8] fp32 blocks (512 bytes, ~350 more of header) holding ``max_files``."""
    tier = DiskTier(root, "ab" * 32, max_bytes=max_files * (512 + 400))
    tier.attach([(torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)) for _ in range(2)])
    return tier


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["fifo", "device", "symlink", "directory"])
def test_what_is_not_a_regular_file_is_never_opened_nor_replaced(tmp_path, caplog, kind):
    """Under a block's name: no block (a miss), not waited on (a FIFO's open blocked the engine thread forever),
    a write over it refused and counted, and it stays where it was."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"the user's")
    tier = _small_tier(tmp_path / "kv", max_files=10)
    key = b"k" * 32
    _plant(tier.path(key), kind, random.Random(0), tier.fingerprint, key, outside)
    with caplog.at_level(logging.WARNING):
        assert not tier.contains(key)
        assert not tier.load(key, 1) and not tier.load(key, 1)  # even when asked, as after a lost race
        for _ in range(3):
            tier.store(key, None, 2)
            tier.flush()
    assert tier.stats()["disk_load_failures"] == 2 and tier.stats()["disk_write_failures"] == 3
    messages = _warnings(caplog)
    assert len(messages) == 2, messages  # one for the read, one for the write: not one per attempt
    assert "not a regular file" in messages[0] and "does not replace it" in messages[1]
    assert os.path.lexists(tier.path(key)) and (outside / "precious.bin").read_bytes() == b"the user's"
    tier.close()


@pytest.mark.timeout(20)
def test_hostile_bytes_under_a_blocks_name_are_one_warning_each_and_a_miss(tmp_path, caplog):
    rng = random.Random(8)
    tier = _small_tier(tmp_path, max_files=40)
    keys = [bytes([i]) * 32 for i in range(30)]
    for key in keys:
        tier.path(key).write_bytes(_hostile_bytes(rng, tier.fingerprint, key))
    with caplog.at_level(logging.WARNING):
        assert not any(tier.load(key, 0) for key in keys)
    messages = _warnings(caplog)
    assert len(messages) == len(keys) and all(len(m) < 600 for m in messages)  # a huge header is not echoed
    assert not any(tier.contains(key) for key in keys)  # the tier's own names: deleted, to be written again
    tier.close()


@pytest.mark.timeout(20)
def test_eviction_deletes_only_the_tiers_own_files(tmp_path, caplog):
    """Under a limit of 3 blocks, 8 written: the user's files next to the tier's survive, at the top of
    kv_cache_dir (a model.safetensors was deleted), behind a symlinked directory, or in the tier's own
    subdirectory under other names; block files of the old layout are kept and reported once."""
    root = tmp_path / "kv"
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir(mode=0o700)
    foreign = [root / "model.safetensors", root / ("ab" * 32 + ".safetensors"), outside / "x.safetensors"]
    (root / "linked").symlink_to(outside)
    own = root / BLOCKS_DIR
    own.mkdir(mode=0o700)
    foreign += [own / "notes.safetensors", own / ("cd" * 32 + ".safetensors.bak"), own / ".tmp-theirs"]
    for path in foreign:
        path.write_bytes(os.urandom(2000))
        os.utime(path, (1, 1))  # the oldest of all: first in line if eviction looked at them
    (own / ("ef" * 32 + ".safetensors")).symlink_to(outside / "x.safetensors")
    before = _digests(foreign)
    with caplog.at_level(logging.WARNING):
        tier = _small_tier(root, max_files=3)
        for i in range(8):
            tier.store(bytes([i]) * 32, None, i)
            tier.flush()
    assert tier.stats()["disk_evictions"] >= 5 and tier.stats()["disk_write_failures"] == 0
    assert _digests(foreign) == before and (own / ("ef" * 32 + ".safetensors")).is_symlink()
    assert [m for m in _warnings(caplog) if "older pagedkv" in m and "neither uses nor deletes" in m]
    tier.close()


@pytest.mark.timeout(20)
def test_a_planted_lock_file_neither_lifts_the_limit_nor_is_trusted(tmp_path, caplog):
    """A total that cannot be one is recounted (it switched the size limit off); a lock file that is a symlink
    is refused: writes fail, counted and logged once, and the file it points to is untouched."""
    tier = _small_tier(tmp_path / "kv", max_files=3)
    lock = tier.directory / LOCK_FILE
    with caplog.at_level(logging.WARNING):
        for i in range(8):
            lock.write_text(f"{-(10**15)} {-(10**15)}\n")
            tier.store(bytes([i]) * 32, None, i)
            tier.flush()
    assert len(list(tier.directory.glob("*.safetensors"))) <= 3
    assert len([m for m in _warnings(caplog) if "recounted" in m]) == 1

    caplog.clear()
    lock.unlink()
    (tmp_path / "precious").write_text("data")
    lock.symlink_to(tmp_path / "precious")
    with caplog.at_level(logging.WARNING):
        for i in range(8, 12):
            tier.store(bytes([i]) * 32, None, i % 8)
            tier.flush()
    assert tier.stats()["disk_write_failures"] == 4
    messages = _warnings(caplog)
    assert len(messages) == 1 and "lock file" in messages[0] and "Delete it" in messages[0], messages
    assert (tmp_path / "precious").read_text() == "data"
    assert not list(tier.directory.glob(".tmp-*"))
    tier.close()


# -- a fuzzed kv_cache_dir under an engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tiny, prompts, tmp_path_factory) -> tuple[Path, dict[str, bytes], str]:
    """A kv_cache_dir an engine filled with every prompt's blocks: (its directory, block name -> key, fingerprint)."""
    kv_dir = tmp_path_factory.mktemp("written")
    llm = LLM(model=tiny, kv_cache_dir=str(kv_dir), num_kv_blocks=128)
    _run(llm, prompts)
    llm.engine.close()
    disk = llm.engine.disk
    names = {disk.name(key): key for prompt in prompts for key in _keys(prompt)}
    return kv_dir, names, disk.fingerprint


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(3))
def test_a_fuzzed_kv_cache_dir_never_fails_hangs_nor_loses_a_file(
    tiny, prompts, reference, written, tmp_path, seed, caplog
):
    source, names, fingerprint = written
    rng = random.Random(seed)
    kv_dir = tmp_path / "kv"
    shutil.copytree(source, kv_dir, symlinks=True)  # modes and mtimes kept
    own = kv_dir / BLOCKS_DIR
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(os.urandom(1000))
    foreign = [outside / "precious.bin", kv_dir / "model.safetensors", own / "README", own / "model.safetensors"]
    for path in foreign[1:]:
        path.write_bytes(rng.randbytes(3000))
        os.utime(path, (1, 1))
    (kv_dir / "linked").symlink_to(outside)
    before = _digests(foreign)
    kinds = ["bytes", "bytes", "oversized", "fifo", "device", "symlink", "directory"]
    planted = {}
    for name in rng.sample(sorted(names), k=len(names) // 2):
        planted[name] = rng.choice(kinds)
        _plant(own / name, planted[name], rng, fingerprint, names[name], outside)
    # Which random plants are ever read depends on the order of the lookups and evictions (a lookup stops at a
    # prompt's first missing block; an oversized plant, 1 GiB by its size, makes the tier evict every file older
    # than itself), so one plant is made certain to be read and refused: hostile bytes under the first block of
    # every prompt, the first thing the first prompt looks up, and the most recently used file.
    first = next(name for name, key in names.items() if key == _keys(prompts[0])[0])
    if planted.get(first) == "directory":
        (own / first).rmdir()
    planted[first] = "bytes"
    _plant(own / first, "bytes", rng, fingerprint, names[first], outside)
    os.utime(own / first, ns=(time.time_ns() + 10**9,) * 2)
    for memo in (kv_dir / "models").iterdir():  # the model's remembered digest: not waited on either
        memo.unlink()
        os.mkfifo(memo)
    (own / LOCK_FILE).write_bytes(rng.randbytes(40))

    with caplog.at_level(logging.WARNING):
        llm = LLM(model=tiny, kv_cache_dir=str(kv_dir), num_kv_blocks=128, kv_cache_disk_gb=6 * BLOCK_FILE / 2**30)
        assert _run(llm, prompts) == reference
        # once more from what the disk holds now. Which files the first pass left depends on how far the writer
        # thread had got when each lookup ran (on a loaded machine, none of the ones looked up first), so one
        # intact file is made certain to be read and used, as the hostile bytes above were to be refused: the
        # first block of every prompt, put back from the written directory once the writer has caught up
        assert llm.engine.disk.flush(timeout=20)
        shutil.copyfile(source / BLOCKS_DIR / first, own / first)
        os.utime(own / first, ns=(time.time_ns() + 10**9,) * 2)
        llm.reset_prefix_cache()
        assert _run(llm, prompts) == reference
        llm.engine.close()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]  # no block leaked
    assert stats["disk_evictions"] > 0  # the limit (6 blocks) was in force
    assert stats["disk_blocks_loaded"] > 0 and stats["disk_load_failures"] > 0 and stats["disk_write_failures"] > 0
    assert _digests(foreign) == before
    for name, kind in planted.items():
        if kind not in ("bytes", "oversized"):  # not a regular file of the tier's: still there, as it was
            assert os.path.lexists(own / name), (name, kind)
    messages = _warnings(caplog)
    write_failures = [m for m in messages if m.startswith("kv_cache_dir: writing a block")]
    assert len(write_failures) <= 1  # one cause (a name held by no block file), logged once
    assert len(messages) <= len(planted) + 3  # one per bad file at most, + the lock's total, + write failures
