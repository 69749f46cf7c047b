"""Shared, session-scoped fixtures: the default model, ours and HF's, each loaded at most once per run,
and ``paged_harness``, which runs a model step by step on hand-managed block tables.

HF's reference is loaded straight from the GGUF file by transformers (not from pagedkv's converted cache),
so it stays independent of our loader. transformers is imported inside the fixtures, so test files that
need no model do not pay for it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from pagedkv.model.llama import LlamaForCausalLM
    from pagedkv.model.loader import LoadedModel


TESTS = Path(__file__).resolve().parent

# Fixtures that load the real default model (or its tokenizer): a test using any of them is marked slow.
REAL_MODEL_FIXTURES = frozenset({"default_model_path", "hf_default_model", "hf_default_tokenizer", "default_model"})

# `make test-fast` runs the tests marked fast and not slow: the files listed here by their path under tests/, each
# measured to need no real model and little time. The number is the CPU seconds of the file's tests past pytest's
# start (`pytest -m "not slow" --durations=3 FILE` under /usr/bin/time, less the ~5 s a bare run takes; AMD EPYC
# Zen 5, 2 cores shared with other jobs): about 80 s together. Files not listed -- tiny models run for many steps,
# kernel builds and sweeps, live servers, hypothesis searches over the disk tier -- took 9 s to over 2 minutes
# each and run in `make test` only. A new file joins the list once measured.
FAST_FILES = {
    "config/test_config.py": 2.2,
    "engine/test_admission.py": 0.4,
    "engine/test_chat_rendering.py": 3.0,
    "engine/test_chat_template_file.py": 2.5,
    "engine/test_core.py": 0.0,
    "engine/test_detokenizer.py": 4.8,
    "engine/test_fair_scheduling.py": 6.6,
    "engine/test_loop.py": 0.5,
    "engine/test_output_processor.py": 0.0,
    "engine/test_runner.py": 3.2,
    "engine/test_scheduler.py": 0.0,
    "engine/test_scheduler_drafts.py": 0.5,
    "engine/test_speculative.py": 1.5,
    "kernels/test_simd_fp16.py": 0.8,
    "kv/test_block_pool.py": 0.3,
    "kv/test_cache_report.py": 6.7,
    "kv/test_manager_stateful.py": 3.9,
    "kv/test_ops.py": 0.9,
    "kv/test_prefix_cache_scenarios.py": 0.0,
    "model/test_checkpoint.py": 0.9,
    "model/test_gguf_blocks.py": 0.9,
    "model/test_loader.py": 5.4,
    "model/test_model_kernels.py": 2.6,
    "project/test_dockerfile.py": 0.0,
    "project/test_docs.py": 1.7,
    "project/test_layout.py": 0.0,
    "project/test_rooms.py": 2.5,
    "replicas/test_forwarding.py": 5.2,
    "replicas/test_prefix_affinity.py": 0.0,
    "replicas/test_replica_options.py": 5.2,
    "replicas/test_routing_keys.py": 5.5,
    "sampling/test_sampling.py": 4.6,
    "server/test_body_values.py": 2.0,
    "server/test_reasoning.py": 4.8,
    "server/test_server_connections.py": 1.9,
    "structured/test_structured_checks.py": 1.5,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark slow every test that uses a real-model fixture, and fast every test `make test-fast` runs."""
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.path.relative_to(TESTS).as_posix() in FAST_FILES:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from pagedkv.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path: str) -> torch.nn.Module:
    """HF transformers' fp32 model of the default GGUF (weights dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model_path: str):
    from transformers import AutoTokenizer

    path = Path(default_model_path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """pagedkv's default model through its own loader: fp32, torch's attention and ops."""
    from pagedkv.model.loader import load_model

    return load_model(None, weight_format="float32")


@pytest.fixture(scope="session")
def paged_harness() -> type[PagedHarness]:
    """The :class:`PagedHarness` class, for tests that run a model step by step without the engine."""
    return PagedHarness


class PagedHarness:
    """Block tables managed by hand: each request gets blocks from a shuffled free list as it grows.

    The pools start as NaN, so a read of any slot that was never written shows up in the logits.
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int = 64, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(model.num_layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """One model call over ``(request, new tokens)`` chunks; logits of every new token."""
        ids, positions, tables, query_lens, seq_lens = [], [], [], [], []
        for rid, new in chunks:
            done = self.tokens.setdefault(rid, [])
            table = self.tables.setdefault(rid, [])
            end = len(done) + len(new)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids += new
            positions += range(len(done), end)
            tables.append(list(table))
            query_lens.append(len(new))
            seq_lens.append(end)
            done += new
        meta = self.model.attention.build_metadata(tables, query_lens, seq_lens, self.block_size)
        logits = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches, torch.arange(len(ids)))
        return list(logits.split(query_lens))

    def greedy(self, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
        """Prefill all prompts in one step, then decode them together (different lengths, one batch)."""
        logits = self.step(list(prompts.items()))
        out = {rid: [int(row[-1].argmax())] for rid, row in zip(prompts, logits, strict=True)}
        for _ in range(steps - 1):
            logits = self.step([(rid, toks[-1:]) for rid, toks in out.items()])
            for toks, row in zip(out.values(), logits, strict=True):
                toks.append(int(row[-1].argmax()))
        return out
