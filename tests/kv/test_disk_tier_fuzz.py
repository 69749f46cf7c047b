"""A fuzzed ``kv_cache_dir`` under a running engine (issue 25's acceptance): random bytes, deep headers, huge
declared shapes, FIFOs, symlinks and foreign files never fail a request, never hang, and never cost a file
the tier did not write.

``test_disk_tier_hostile`` plants trouble under block names before an engine starts. Here, for each seed,
the whole tree is fuzzed and fuzzed again while the engine runs:

- before it starts: foreign files at the top of ``kv_cache_dir`` (a ``model.safetensors``, an old-layout
  block name, a FIFO, a symlink to a directory outside) and in the tier's own subdirectory under names
  that are not its scheme (upper-case hex, ``.bak``, a ``.tmp-`` name that is not hex, a subdirectory
  holding a block-named file), and trouble under the names of blocks the prompts will look up;
- between requests: half the block files the tier has just written are swapped for trouble (the same
  kinds, plus a copy of another block's file and a hard link to a file outside), the lock file for
  random bytes, and the prefix cache is reset so that every block is looked up on disk again;
- at a restart: the model digests remembered in ``models/`` are random bytes, a FIFO, or ``models/``
  is a symlink to a directory outside.

Trouble is: random bytes, a JSON header nested thousands deep, huge declared shapes or offsets, a header
length past the file, a FIFO, a symlink to a file, to a directory, to a FIFO or to nothing, a directory, a
hard link to a file outside. After every round: the outputs are those of an engine without the disk tier
(token ids and logprobs, bit for bit), no KV block is held, no round hung (a FIFO opened for reading
blocks forever: a round still running after ``ROUND_WAIT_S`` fails, and its FIFOs get a writer so that it
ends), and at the end no foreign file changed (content and mtime), none is missing, nothing new appeared
outside, and no planted non-file was removed or replaced. Seeded, a few dozen files a seed, ~5 s a seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.kv.block_directory import BLOCK_NAME, BLOCKS_DIR, LOCK_FILE, BlockDirectory
from pagedkv.kv.disk_files import FORMAT, MAX_HEADER
from pagedkv.kv.hashing import extend_block_keys
from tests.tiny_model import save_tiny_llama

GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
BLOCK_FILE = 2 * 2 * 16 * 2 * 64 * 4 + 400  # the tiny model's block file: K and V, 2 layers, fp32, + header
DISK_BLOCKS = 12  # the tier's size limit, in blocks: fewer than the prompts have, so eviction runs
# Only ends a round that hung: a seed's five rounds (engine starts, six prompts each on the tiny model) took
# 12-21 s in all on 2 busy cores. Before, only the test's 180 s timeout ended a hang (it counted the module's
# fixtures too): three seeds with the FIFO guards removed took 436 s, now 189 s.
ROUND_WAIT_S = 60.0
TROUBLE = [
    "random",
    "deep",
    "shape",
    "header_len",
    "fifo",
    "file_link",
    "dir_link",
    "fifo_link",
    "dangling",
    "directory",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Six prompts: two groups behind their own 48-token system prompt, each with its own tail of blocks."""
    rng = random.Random(2525)
    systems = [[rng.randrange(4, 512) for _ in range(48)] for _ in range(2)]
    return [systems[i % 2] + [rng.randrange(4, 512) for _ in range(rng.randrange(20, 50))] for i in range(6)]


@pytest.fixture(scope="module")
def reference(tiny, prompts) -> list[tuple]:
    llm = LLM(model=tiny, num_kv_blocks=128, enable_prefix_caching=False)
    return _run(llm, prompts)


def _run(llm: LLM, prompts) -> list[tuple]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _keys(prompt: list[int]) -> list[bytes]:
    keys: list[bytes] = []
    extend_block_keys(keys, prompt, 16)
    return keys


def _header_file(header: object, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def _trouble_bytes(kind: str, rng: random.Random, fingerprint: str, key: bytes) -> bytes:
    meta = {"format": FORMAT, "fingerprint": fingerprint, "key": key.hex(), "parent": "", "sha256": "0" * 64}
    depth = rng.randrange(1_000, MAX_HEADER // 2)
    if kind == "random":
        return rng.randbytes(rng.randrange(0, 3 * BLOCK_FILE))
    if kind == "deep":
        opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}"), (b'[{"k":"]]":', b"}]")])
        levels = depth // len(opener)
        return _header_file(opener * levels + b"0" + closer * levels)
    if kind == "shape":
        shape = rng.choice([[10**12] * 5, [2**63, 1], [-1, 2, 16, 2, 64], [2, 2, 16, 2, 64]])
        offsets = rng.choice([[0, 10**60], [-64, 32704], [0, 2**64], [0, 32768]])
        entry = {"dtype": rng.choice(["F32", "F16", "I64", "??"]), "shape": shape, "data_offsets": offsets}
        return _header_file({"__metadata__": meta, "kv": entry}, rng.randbytes(rng.choice([0, 32768])))
    assert kind == "header_len"
    return rng.choice([2**64 - 1, MAX_HEADER, MAX_HEADER + 1, 10**9]).to_bytes(8, "little") + b'{"a": 1}'


class Garden:
    """Everything planted in one seed's tree, and what must hold of it at the end."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root, self.rng = root, rng
        self.kv_dir, self.own, self.outside = root / "kv", root / "kv" / BLOCKS_DIR, root / "outside"
        self.foreign: list[Path] = []  # regular files that are not the tier's: content and mtime kept
        self.kept: list[Path] = []  # non-files planted in the tier's subdirectory: never removed nor replaced
        self.planted = 0
        for directory in (self.kv_dir, self.own, self.outside, self.outside / "dir"):
            directory.mkdir(mode=0o700)
        self.precious = self._foreign(self.outside / "precious.bin")
        self._foreign(self.outside / "dir" / ("ab" * 32 + ".safetensors"))
        os.mkfifo(self.outside / "pipe")

    def _foreign(self, path: Path) -> Path:
        path.write_bytes(self.rng.randbytes(self.rng.randrange(100, 3000)))
        os.utime(path, ns=(10**9, 10**9))  # the oldest of all: first in line if eviction looked at them
        self.foreign.append(path)
        return path

    def foreign_files(self) -> None:
        """The user's files around the tier's, none of them in its scheme."""
        for name in ("model.safetensors", "config.json", "cd" * 32 + ".safetensors", ".lock"):
            self._foreign(self.kv_dir / name)  # an old-layout block name, a lock at the wrong level
        os.mkfifo(self.kv_dir / "pipe")
        (self.kv_dir / "linked").symlink_to(self.outside / "dir")
        for name in ("model.safetensors", "README", "EF" * 32 + ".safetensors", "ab" * 32 + ".safetensors.bak"):
            self._foreign(self.own / name)
        self._foreign(self.own / ".tmp-not-hex-at-all")
        (self.own / "sub").mkdir()
        self._foreign(self.own / "sub" / ("12" * 32 + ".safetensors"))
        (self.own / "elsewhere").symlink_to(self.outside)
        self.kept += [self.own / "sub", self.own / "elsewhere"]

    def trouble(self, path: Path, fingerprint: str, key: bytes, kinds: list[str]) -> str:
        """Put a random kind of trouble under ``path`` (a block's name); which one."""
        kind = self.rng.choice(kinds)
        path.unlink(missing_ok=True)
        self.planted += 1
        if kind in ("random", "deep", "shape", "header_len"):
            path.write_bytes(_trouble_bytes(kind, self.rng, fingerprint, key))
            return kind  # a regular file under the tier's name: the tier's to delete
        if kind == "copy":  # a whole, valid block file of another block
            others = [p for p in self.block_files() if p != path]
            if others:
                shutil.copyfile(self.rng.choice(others), path)
                return kind
            path.write_bytes(b"")
            return "random"
        if kind == "hard_link":  # the name is the tier's, the file is the user's: it must survive
            os.link(self.precious, path)
            return kind
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "file_link":
            path.symlink_to(self.precious)
        elif kind == "dir_link":
            path.symlink_to(self.outside / "dir")
        elif kind == "fifo_link":
            path.symlink_to(self.outside / "pipe")
        elif kind == "dangling":
            path.symlink_to(self.outside / "nothing-here")
        else:
            assert kind == "directory"
            path.mkdir()
            self._foreign(path / "inside.bin")
        self.kept.append(path)
        return kind

    def block_files(self) -> list[Path]:
        """The block files the tier wrote: regular, of its scheme, one link, not planted."""
        found = []
        for path in sorted(self.own.iterdir()):
            info = path.lstat()
            if BLOCK_NAME.fullmatch(path.name) and stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                found.append(path)
        return found

    def snapshot(self) -> dict[str, object]:
        return {
            "foreign": {p: _identity(p) for p in self.foreign},
            "kept": {p: os.lstat(p)[stat.ST_INO] if os.path.lexists(p) else None for p in self.kept},
            "outside": sorted(str(p) for p in self.outside.rglob("*")),
        }


def _identity(path: Path) -> tuple[str, int] | None:
    """A file's sha256 and mtime; None if it is gone."""
    if not path.exists():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _fifos(root: Path) -> Iterator[str]:
    for directory, _, names in os.walk(root):  # symlinks not followed: every FIFO planted is under root
        for name in names:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(os.lstat(path).st_mode):
                    yield path


@contextlib.contextmanager
def bounded(root: Path, what: str) -> Iterator[None]:
    """Fail ``what`` if it still runs ``ROUND_WAIT_S`` after it began, and free it then: each FIFO under
    ``root`` gets a writer that leaves at once, again and again, so that a reader waiting on one gets an
    empty file and the round ends now, not at the test's timeout."""
    done, hung = threading.Event(), threading.Event()

    def watch() -> None:
        if done.wait(ROUND_WAIT_S):
            return
        hung.set()
        while not done.is_set():
            for fifo in _fifos(root):
                with contextlib.suppress(OSError):  # no reader waiting: ENXIO
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            done.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        assert not hung.is_set(), f"{what} still ran after {ROUND_WAIT_S} s: it waited on a FIFO"


def _assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0, stats  # every request's blocks came back, loaded or not


@pytest.mark.parametrize("seed", range(3))
def test_a_fuzzed_kv_cache_dir_under_a_running_engine(tiny, prompts, reference, tmp_path, seed):
    rng = random.Random(seed)
    garden = Garden(tmp_path, rng)
    garden.foreign_files()
    keys = sorted({key for prompt in prompts for key in _keys(prompt)})
    disk_gb = DISK_BLOCKS * BLOCK_FILE / 2**30

    with bounded(tmp_path, "the engine's start"):
        llm = LLM(model=tiny, kv_cache_dir=str(garden.kv_dir), num_kv_blocks=128, kv_cache_disk_gb=disk_gb)
    disk = llm.engine.disk
    names = {disk.name(key): key for key in keys}
    for key in rng.sample(keys, k=len(keys) // 3):  # trouble where the prompts will look
        garden.trouble(disk.path(key), disk.fingerprint, key, TROUBLE)
    snapshot = garden.snapshot()
    with bounded(tmp_path, "the first round"):
        assert _run(llm, prompts) == reference
    _assert_idle(llm)

    for _ in range(2):  # the tier's own files swapped under it, between requests
        disk.flush()
        written = garden.block_files()
        for i, path in enumerate(rng.sample(written, k=len(written) // 2)):
            key = names.get(path.name, bytes(32))  # a block of generated tokens: a key no prompt has
            kinds = ["hard_link"] if i < 2 else [*TROUBLE, "copy", "copy", "hard_link"]
            garden.trouble(path, disk.fingerprint, key, kinds)
        (garden.own / LOCK_FILE).write_bytes(rng.randbytes(40))
        snapshot = garden.snapshot()  # hard links and new non-files join what must hold
        llm.reset_prefix_cache()
        with bounded(tmp_path, "a round after the swap"):
            assert _run(llm, prompts) == reference
        _assert_idle(llm)
    llm.engine.close()
    stats = llm.stats()
    assert stats["disk_blocks_loaded"] > 0 and stats["disk_load_failures"] > 0

    memos = garden.kv_dir / "models"  # a restart, with the remembered model digests fuzzed too
    if seed % 3 == 0:
        shutil.rmtree(memos)
        memos.symlink_to(garden.outside)
    else:
        for memo in memos.iterdir():
            memo.unlink()
            if seed % 3 == 1:
                os.mkfifo(memo)
            else:
                memo.write_bytes(rng.randbytes(64))
    snapshot["outside"] = sorted(str(p) for p in garden.outside.rglob("*"))
    with bounded(tmp_path, "the restart's round"):
        llm = LLM(model=tiny, kv_cache_dir=str(garden.kv_dir), num_kv_blocks=128, kv_cache_disk_gb=disk_gb)
        assert _run(llm, prompts) == reference
    _assert_idle(llm)
    llm.engine.close()
    stats = llm.stats()
    assert stats["disk_blocks_loaded"] > 0  # it still serves what it wrote
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]

    after = garden.snapshot()
    for part in ("foreign", "kept"):
        changed = {str(p): (was, after[part].get(p)) for p, was in snapshot[part].items() if after[part].get(p) != was}
        assert not changed, (part, changed)
    assert after["outside"] == snapshot["outside"]
    assert garden.planted >= 10


@pytest.mark.timeout(10)
def test_touch_stamps_only_a_file_the_tier_could_have_written(tmp_path):
    """A prefix hit in memory touches the block's file on disk: under its name may now be the user's file
    (a hard link), a symlink or a FIFO. None of them is stamped, waited on or followed."""
    files = BlockDirectory(tmp_path / "kv", max_bytes=1 << 20)
    user = tmp_path / "user.bin"
    user.write_bytes(b"the user's")
    os.utime(user, ns=(10**9, 10**9))
    names = [f"{i:064x}.safetensors" for i in range(4)]
    os.link(user, files.directory / names[0])
    (files.directory / names[1]).symlink_to(user)
    os.mkfifo(files.directory / names[2])
    assert files.put(names[3], b"a block")
    os.utime(files.directory / names[3], ns=(10**9, 10**9))
    for name in names:
        files.touch(name)
    assert user.stat().st_mtime_ns == 10**9 and user.read_bytes() == b"the user's"
    assert (files.directory / names[3]).stat().st_mtime_ns > 10**9  # the tier's own file is stamped
