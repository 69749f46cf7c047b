"""The prefix cache's disk tier (``LLM(kv_cache_dir=...)``): a restarted engine hits the blocks an earlier one
wrote and gives the same bits as a cold computation; another model or block size finds nothing; a bad file
is reported once and never served; the size limit holds, least recently used out first; processes share a
directory without corrupting it.

Outputs are compared with ``==`` on token ids and every logprob (README: Determinism): a block loaded with
one wrong bit would show. Engines run the tiny random Llama, except one restart on the default model.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.config import EngineConfig
from pagedkv.kv.block_directory import SUFFIX
from pagedkv.kv.cache_dir import BLOCKS_DIR
from pagedkv.kv.disk_files import CorruptBlockFile
from pagedkv.kv.disk_fingerprint import engine_fingerprint
from pagedkv.kv.disk_tier import DiskTier
from pagedkv.kv.hashing import extend_block_keys
from tests.tiny_model import save_tiny_llama

GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, seed=7, logprobs=2)
SCORED = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=2)
ROOT = Path(__file__).resolve().parents[2]
DISK_LOGGER = "pagedkv.kv.disk_tier"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _prompts(seed: int = 3, n: int = 6) -> list[list[int]]:
    """n prompts behind one shared 100-token "system prompt" (6 full blocks of 16), each with its own tail."""
    rng = random.Random(seed)
    system = [rng.randrange(4, 512) for _ in range(100)]
    return [system + [rng.randrange(4, 512) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def _bits(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


def _run(llm: LLM, prompts, params=GREEDY) -> list[tuple]:
    return _bits(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))


def _engine(model: str, kv_dir: Path | None, **options) -> LLM:
    options.setdefault("num_kv_blocks", 256)
    return LLM(model=model, kv_cache_dir=None if kv_dir is None else str(kv_dir), **options)


def _block_files(kv_dir: Path) -> list[Path]:
    """The block files of ``kv_dir`` (the disk tier keeps them in its own subdirectory)."""
    return sorted(p for p in (kv_dir / BLOCKS_DIR).iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))


def _reference(model: str, prompts, params=GREEDY) -> list[tuple]:
    return _run(_engine(model, None, enable_prefix_caching=False), prompts, params)


@pytest.mark.parametrize("params", [GREEDY, SEEDED, SCORED], ids=["greedy", "seeded", "scored"])
def test_a_restarted_engine_hits_the_disk_and_gives_the_bits_of_a_cold_run(tiny, tmp_path, params):
    prompts = _prompts()
    cold = _reference(tiny, prompts, params)
    first = _engine(tiny, tmp_path)
    assert _run(first, prompts, params) == cold
    before = first.stats()
    assert _run(first, prompts, params) == cold  # warm, in memory
    warm_computed = first.stats()["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert first.stats()["disk_blocks_written"] > 0
    first.engine.close()  # finishes the queued writes; a new engine is a restart

    restarted = _engine(tiny, tmp_path)
    outputs = restarted.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _bits(outputs) == cold
    stats = restarted.stats()
    assert stats["disk_blocks_loaded"] > 0 and stats["disk_load_failures"] == 0
    assert stats["prompt_tokens_computed"] <= warm_computed  # the first round computes no more than a warm one
    assert all(o.num_cached_tokens == (len(p) - 1) // 16 * 16 for o, p in zip(outputs, prompts))
    assert {o.cache_miss_reason for o in outputs} == {"hit"}  # a disk hit is a hit


def test_an_fp16_pool_round_trips_through_the_disk(tiny, tmp_path):
    """kv_cache_dtype="float16": its blocks are written as F16 files and a restart serves them with the bits of
    a cold fp16 run; an fp32 engine on the same directory finds none of them (the fingerprint has the dtype)."""
    prompts = _prompts(seed=9)
    cold = _run(_engine(tiny, None, enable_prefix_caching=False, kv_cache_dtype="float16"), prompts)
    first = _engine(tiny, tmp_path, kv_cache_dtype="float16")
    assert _run(first, prompts) == cold
    first.engine.close()
    header = _block_files(tmp_path)[0].read_bytes()
    assert b'"dtype":"F16"' in header[: 8 + int.from_bytes(header[:8], "little")]
    restarted = _engine(tiny, tmp_path, kv_cache_dtype="float16")
    assert _run(restarted, prompts) == cold
    assert restarted.stats()["disk_blocks_loaded"] > 0 and restarted.stats()["disk_load_failures"] == 0
    wide = _engine(tiny, tmp_path)
    _run(wide, prompts[:1])
    assert wide.stats()["disk_blocks_loaded"] == 0


def test_only_the_first_requests_prefix_is_on_disk(tiny, tmp_path):
    """The disk holds one prompt; a restart serves its system prompt to every other request."""
    prompts = _prompts(seed=5)
    cold = _reference(tiny, prompts)
    first = _engine(tiny, tmp_path)
    _run(first, prompts[:1])
    first.engine.close()
    restarted = _engine(tiny, tmp_path)
    outputs = restarted.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert _bits(outputs) == cold
    assert all(o.num_cached_tokens >= 96 for o in outputs)  # the 6 system blocks, from disk or memory
    assert restarted.stats()["disk_blocks_loaded"] == (len(prompts[0]) - 1) // 16


def test_another_model_file_or_block_size_finds_nothing(tmp_path):
    model = tmp_path / "model"
    save_tiny_llama(model, seed=0)
    kv_dir = tmp_path / "kv"
    prompts = _prompts(seed=9, n=3)
    writer = _engine(str(model), kv_dir)
    _run(writer, prompts)
    writer.engine.close()
    written = len(_block_files(kv_dir))
    assert written > 0

    save_tiny_llama(model, seed=1)  # another checkpoint at the same path
    cold = _reference(str(model), prompts)
    other = _engine(str(model), kv_dir)
    assert _run(other, prompts[:1]) == cold[:1]
    assert other.stats()["disk_blocks_loaded"] == 0 and other.stats()["prefix_cache_hits"] == 0

    save_tiny_llama(model, seed=0)  # the first model again, another block size
    wider = _engine(str(model), kv_dir, block_size=32)
    _run(wider, prompts[:1])
    assert wider.stats()["disk_blocks_loaded"] == 0 and wider.stats()["prefix_cache_hits"] == 0

    same = _engine(str(model), kv_dir)  # and the first model as it was: everything is still there
    _run(same, prompts[:1])
    assert same.stats()["disk_blocks_loaded"] > 0


def test_the_fingerprint_covers_what_decides_the_bits(tiny, tmp_path):
    base = {
        "weight_format": "float32",
        "kernels": True,
        "gemm": True,
        "attention": "kernel",
        "block_size": 16,
        "kv_dtype": torch.float32,
    }
    fingerprint, covers = engine_fingerprint(tiny, tmp_path, **base)
    assert covers["model"] and fingerprint == engine_fingerprint(tiny, tmp_path, **base)[0]
    for name, value in [
        ("weight_format", "gguf"),
        ("kernels", False),
        ("gemm", False),
        ("attention", "gather"),
        ("block_size", 32),
        ("kv_dtype", torch.bfloat16),
    ]:
        assert engine_fingerprint(tiny, tmp_path, **{**base, name: value})[0] != fingerprint, name


def _keys(prompt: list[int]) -> list[bytes]:
    keys: list[bytes] = []
    extend_block_keys(keys, prompt, 16)
    return keys


def test_a_corrupted_or_truncated_file_is_reported_once_and_never_served(tiny, tmp_path, caplog):
    prompts = _prompts(seed=13, n=2)
    cold = _reference(tiny, prompts)
    writer = _engine(tiny, tmp_path)
    _run(writer, prompts)
    writer.engine.close()
    target = writer.engine.disk.path(_keys(prompts[0])[1])  # the second block of the first prompt

    for damage in ("flip", "truncate"):
        data = bytearray(target.read_bytes())
        if damage == "flip":  # the K/V bytes, not the header: only the checksum can tell
            data[-3000:-2000] = b"\x7f" * 1000
        else:
            del data[-100:]
        target.write_bytes(bytes(data))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=DISK_LOGGER):
            engine = _engine(tiny, tmp_path)
            assert _run(engine, prompts) == cold
            assert _run(engine, prompts) == cold
        warnings = [r for r in caplog.records if r.name == DISK_LOGGER and r.levelno == logging.WARNING]
        assert len(warnings) == 1, damage
        assert target.name in warnings[0].getMessage()
        assert ("checksum" if damage == "flip" else "truncated") in warnings[0].getMessage()
        assert engine.stats()["disk_load_failures"] == 1
        engine.engine.close()  # the block was computed again, and written again

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=DISK_LOGGER):
        healed = _engine(tiny, tmp_path)
        assert _run(healed, prompts) == cold
    assert not caplog.records
    assert healed.stats()["disk_blocks_loaded"] == sum((len(p) - 1) // 16 for p in prompts) - 6  # system: once


def _small_tier(
    directory: Path, max_files: float, fingerprint: str = "ab" * 32
) -> tuple[DiskTier, list[tuple[torch.Tensor, torch.Tensor]]]:
    pools = [(torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)) for _ in range(2)]
    block_bytes = 4 * 2 * 2 * 4 * 2 * 8  # K and V, 2 layers, [4, 2, 8] each, fp32
    tier = DiskTier(directory, fingerprint, max_bytes=int(max_files * (block_bytes + 400)))  # ~350-byte header
    tier.attach(pools)
    assert tier.block_bytes == block_bytes
    return tier, pools


def test_the_size_limit_holds_and_the_least_recently_used_go_first(tmp_path):
    tier, pools = _small_tier(tmp_path, max_files=5)
    keys = [bytes([i]) * 32 for i in range(8)]
    for i in range(5):
        tier.store(keys[i], None, i)
        tier.flush()
    assert all(tier.contains(k) for k in keys[:5])
    assert tier.load(keys[0], 7)  # used: now the most recent
    assert torch.equal(pools[1][1][7], pools[1][1][0])
    tier.touch([keys[1]])  # a hit in memory counts as a use too
    tier.store(keys[5], None, 5)
    tier.flush()
    kept = [tier.contains(k) for k in keys[:6]]
    assert kept == [True, True, False, False, True, True]  # 2 and 3 were the least recently used
    assert sum(p.stat().st_size for p in _block_files(tmp_path)) <= tier.max_bytes
    assert tier.stats()["disk_evictions"] == 2
    tier.close()


def test_a_file_under_another_key_or_fingerprint_is_refused(tmp_path):
    tier, _ = _small_tier(tmp_path, max_files=10)
    tier.store(b"k" * 32, None, 0)
    tier.flush()
    data = bytearray(tier.path(b"k" * 32).read_bytes())
    tier.decode(bytearray(data), b"k" * 32)  # fine as it is
    with pytest.raises(CorruptBlockFile, match="another block"):
        tier.decode(bytearray(data), b"q" * 32)
    other, _ = _small_tier(tmp_path, max_files=10, fingerprint="cd" * 32)
    with pytest.raises(CorruptBlockFile, match="another block"):
        other.decode(bytearray(data), b"k" * 32)
    assert not other.contains(b"k" * 32)  # and it would not even look there: the name has the fingerprint
    tier.close()
    other.close()


_CHILD = """
import json, sys
from pagedkv import LLM, SamplingParams
model, kv_dir, job = sys.argv[1:4]
job = json.loads(open(job).read())
llm = LLM(model=model, kv_cache_dir=kv_dir, kv_cache_disk_gb=job["gb"], num_kv_blocks=64)
params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
for _ in range(job["rounds"]):
    llm.reset_prefix_cache()  # memory forgotten: what is not computed again comes from the disk
    outs = llm.generate(prompt_token_ids=job["prompts"], sampling_params=params, use_tqdm=False)
    bits = [[o.outputs[0].token_ids, o.outputs[0].logprobs] for o in outs]
    if bits != job["expected"]:
        sys.exit("outputs differ from the cold run")
llm.engine.close()
print(json.dumps(llm.stats()))
"""


def test_two_processes_share_a_directory_without_corrupting_it(tiny, tmp_path, caplog):
    """Two engines in two processes write, evict and read one directory at once, under a limit far smaller
    than what they write; both stay correct, and so does every file left."""
    kv_dir = tmp_path / "kv"
    prompts = _prompts(seed=21, n=12)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    expected = [[t, lp] for t, lp, _ in _reference(tiny, prompts, params)]
    block_file = 2 * 2 * 16 * 2 * 64 * 4 + 400
    gb = 30 * block_file / 2**30  # 30 blocks; the prompts have ~90
    children = []
    for i in range(2):
        order = list(range(len(prompts)))[::-1] if i else list(range(len(prompts)))
        job = tmp_path / f"job{i}.json"
        job.write_text(
            json.dumps(
                {
                    "gb": gb,
                    "rounds": 3,
                    "prompts": [prompts[j] for j in order],
                    "expected": [expected[j] for j in order],
                }
            )
        )
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, tiny, str(kv_dir), str(job)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = [c.communicate(timeout=300) for c in children]
    for child, (_, err) in zip(children, results):
        assert child.returncode == 0, err[-2000:]
        assert "not used" not in err, err[-2000:]  # no file was ever found bad
    stats = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert sum(s["disk_evictions"] for s in stats) > 0 and sum(s["disk_blocks_loaded"] for s in stats) > 0

    files = _block_files(kv_dir)
    assert files and sum(p.stat().st_size for p in files) <= int(gb * 2**30)
    assert not [p for p in (kv_dir / BLOCKS_DIR).iterdir() if p.name.startswith(".tmp-")]
    with caplog.at_level(logging.WARNING, logger=DISK_LOGGER):
        reader = _engine(tiny, kv_dir, kv_cache_disk_gb=gb)
        assert [[t, lp] for t, lp, _ in _run(reader, prompts, params)] == expected
    assert not caplog.records
    disk = reader.engine.disk
    for path in files:  # every file left is whole, and named by its own key
        if path.exists():
            data = bytearray(path.read_bytes())
            header = json.loads(bytes(data[8 : 8 + int.from_bytes(data[:8], "little")]))
            key = bytes.fromhex(header["__metadata__"]["key"])
            assert disk.path(key) == path
            disk.decode(data, key)


def test_options_that_cannot_work_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineConfig(kv_cache_dir=str(tmp_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(kv_cache_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_cache_disk_gb must be > 0"):
        EngineConfig(kv_cache_dir=str(tmp_path), kv_cache_disk_gb=0)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by other users"):
        DiskTier(shared, "ab" * 32, 1 << 20)


def _refuse_as(kv_dir: Path, problem: str) -> None:
    """Make ``kv_dir`` a kv_cache_dir the engine must refuse, in one of the ways a start-up meets."""
    if problem == "a file":
        kv_dir.write_text("not a directory")
        return
    (kv_dir / BLOCKS_DIR).parent.mkdir(mode=0o700)
    if problem == "writable by other users":
        kv_dir.chmod(0o777)
    elif problem == "a symlink":  # its own subdirectory, pointing elsewhere
        (kv_dir / BLOCKS_DIR).symlink_to(kv_dir.parent)
    else:  # a planted lock file: a symlink to a file the tier would truncate
        (kv_dir / BLOCKS_DIR).mkdir(mode=0o700)
        (kv_dir.parent / "precious").write_text("data")
        (kv_dir / BLOCKS_DIR / ".lock").symlink_to(kv_dir.parent / "precious")


@pytest.mark.parametrize(
    ("problem", "reason", "advice"),
    [
        ("a file", "is not a directory", "point --kv-cache-dir"),
        ("writable by other users", "is writable by other users", "chmod go-w"),
        ("a symlink", "is a symlink, not a directory", "Remove it"),
        ("a lock", "lock file .* is a symlink", "Delete it"),
    ],
)
def test_a_refused_kv_cache_dir_fails_before_the_model_loads(tiny, tmp_path, monkeypatch, problem, reason, advice):
    """Start-up refuses the directory in a moment, naming it and what to change, before loading the model
    (a refusal used to come only after it, minutes in for a large one)."""

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before kv_cache_dir was checked")

    monkeypatch.setattr("pagedkv.engine.builder.load_model", no_model)
    kv_dir = tmp_path / "kv"
    _refuse_as(kv_dir, problem)
    with pytest.raises(OSError, match=reason) as refused:
        LLM(model=tiny, kv_cache_dir=str(kv_dir))
    assert str(kv_dir) in str(refused.value) and advice in str(refused.value)
    if problem == "a lock":
        assert (tmp_path / "precious").read_text() == "data"


@pytest.mark.slow
def test_default_model_restarted_answers_the_system_prompt_from_disk(tmp_path):
    """The workload's first chat request: a restarted engine takes its system prompt from disk, same bits."""
    data = json.loads((ROOT / "workloads" / "chat_shared_prefix.json").read_text())
    chat = [{"role": "system", "content": data["system"]}, {"role": "user", "content": data["questions"][0]}]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    first = LLM(kv_cache_dir=str(tmp_path), num_kv_blocks=256, max_model_len=1024)
    cold = first.chat([chat], params, use_tqdm=False)[0]
    first.engine.close()
    restarted = LLM(kv_cache_dir=str(tmp_path), num_kv_blocks=256, max_model_len=1024)
    warm = restarted.chat([chat], params, use_tqdm=False)[0]
    assert (warm.outputs[0].token_ids, warm.outputs[0].logprobs) == (
        cold.outputs[0].token_ids,
        cold.outputs[0].logprobs,
    )
    num_prompt = len(warm.prompt_token_ids)
    assert warm.num_cached_tokens == (num_prompt - 1) // 16 * 16 and warm.cache_miss_reason == "hit"
    assert restarted.stats()["disk_blocks_loaded"] == (num_prompt - 1) // 16
    assert restarted.stats()["prompt_tokens_computed"] == num_prompt - warm.num_cached_tokens
