"""build_engine: an EngineConfig in, the engine's parts out -- the one place the engine is put together.

Every part gets what it needs in its constructor, in dependency order (workers, model, disk tier, KV
manager, scheduler, runner, core, output processor), so no part is finished by someone else afterwards.
A tensor-parallel worker (ranks 1..N-1) builds its own, smaller set here too: its shard and a runner, with no
scheduler, KV manager state or sampler (it runs the flat steps rank 0 broadcasts).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from pagedkv import kernels
from pagedkv.attention.paged import select_backend
from pagedkv.config import EngineConfig
from pagedkv.engine.chat_templates import load_chat_template
from pagedkv.engine.core import EngineCore
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.runner import ModelRunner, kv_block_bytes
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.step_inputs import StepInputs
from pagedkv.kv.block_directory import prepare_directory
from pagedkv.kv.disk_fingerprint import engine_fingerprint
from pagedkv.kv.disk_tier import DiskTier
from pagedkv.kv.events import KVEventPublisher, KVEventRecorder, check_endpoint
from pagedkv.kv.hybrid import HybridKVCacheManager, split_kv_budget, window_group_need
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.ops import KV_DTYPES
from pagedkv.model.loader import LoadedModel, default_model_path, load_model, model_directory
from pagedkv.model.spec import ModelSpec
from pagedkv.parallel import wire, workers
from pagedkv.parallel.group import SINGLE, TensorParallel
from pagedkv.sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineParts:
    """The built engine. The core and the processor are what the loop drives; the rest is what requests are
    checked against and what the engine's owner inspects or closes."""

    core: EngineCore  # scheduler, KV cache, runner, sampler: token ids in and out
    processor: OutputProcessor  # the text side: detokenizing, stop strings, RequestOutputs
    runner: ModelRunner  # the model, its KV pools and the other tensor-parallel ranks (runner.workers)
    loaded: LoadedModel  # the tokenizer, the HF config, the end-of-sequence ids, the resolved path and format


def build_engine(config: EngineConfig) -> EngineParts:
    """Load the model and build every part; the workers, the disk tier and the KV event socket are closed
    when the core is garbage-collected, and at exit."""
    if config.kv_cache_dir is not None:  # refused in a moment, before the model loads, not minutes after
        prepare_directory(config.kv_cache_dir)
    if config.kv_events_endpoint is not None:  # the same
        check_endpoint(config.kv_events_endpoint, config.kv_events_allow_remote)
    template = None if config.chat_template is None else load_chat_template(config.chat_template)  # the same
    torch.set_num_threads(workers.rank_threads(config))
    attention = select_backend(config.attention_backend)
    use_kernels = kernels.use_kernels(config.kernels)
    ranks, disk = _start_workers(config), None
    try:
        tp = SINGLE if ranks is None else ranks.tp
        loaded = load_model(config.model, config.weight_format, attention, use_kernels, tp, config.max_model_len)
        if template is not None:
            loaded.tokenizer.chat_template = template
        model, kv_dtype = loaded.model, KV_DTYPES[config.kv_cache_dtype]
        block_bytes = kv_block_bytes(model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, kv_dtype)
        num_blocks = config.num_kv_blocks or max(1, int(config.kv_cache_memory_gb * 2**30) // block_bytes)
        disk = None if config.kv_cache_dir is None else _open_disk_tier(config, loaded, use_kernels, kv_dtype)
        kv = _make_kv_manager(config, model.spec, num_blocks, tp.world_size, disk)
        max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        eos_token_ids = frozenset(loaded.eos_token_ids)
        scheduler = Scheduler(
            kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.num_speculative_tokens,
            max_model_len,
            eos_token_ids,
            max_seqs_per_group=max(1, int(config.max_seq_share_per_request * config.max_num_seqs)),
            max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
        )
        if ranks is not None:
            tp.broadcast(torch.tensor([num_blocks]), idle=True)  # each worker's pool: its KV heads, every block
        runner = ModelRunner(model, kv, tp, ranks, kv_dtype)
    except BaseException:  # nothing started is left running
        for part in (p for p in (ranks, disk) if p is not None):
            part.close()
        raise
    if disk is not None:
        disk.attach(runner.kv_caches)
    kv_events = KVEventPublisher(config.kv_events_endpoint, config.kv_events_allow_remote)
    if kv_events.endpoint is not None:
        kv.record_events(KVEventRecorder(config.block_size))
        logger.info("publishing KV events on %s", kv_events.endpoint)
    core = EngineCore(scheduler, runner, Sampler(eos_token_ids=eos_token_ids), kv_events)
    for part in (p for p in (ranks, disk, kv_events) if p is not None):  # at exit too: queued disk writes finish
        weakref.finalize(core, part.close)
    _log_ready(config, runner, loaded.path, max_model_len, use_kernels)
    return EngineParts(core, OutputProcessor(loaded.tokenizer), runner, loaded)


def _start_workers(config: EngineConfig) -> workers.Workers | None:
    """The other tensor-parallel ranks (None with one rank), started before rank 0 loads its shard."""
    if config.tensor_parallel_size == 1:
        return None
    model_directory(config.model)  # a GGUF file's metadata converted once, here, not by every rank
    model_path = config.model or default_model_path()
    _check_divides(model_path, config.tensor_parallel_size, config.tensor_parallel_exact)
    return workers.start(config, model_path, _serve_worker)


def _check_divides(model_path: str, world: int, exact: bool) -> None:
    """Refuse a size that does not split the heads and the MLP, before any process starts."""
    spec = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(model_directory(model_path)))
    tp = TensorParallel(0, world)
    tp.split(spec.num_heads, "query heads")
    tp.split(spec.num_kv_heads, "KV heads")
    tp.split(spec.intermediate_size, "MLP width")
    if exact:
        tp.split(spec.hidden_size, "hidden size")


def _serve_worker(tp: TensorParallel, config: EngineConfig, model_path: str) -> None:
    """A worker's life, which parallel/workers.py starts (so the comms room never builds a model): load the
    shard, size the pool as rank 0 says, run steps until told to stop."""
    attention = select_backend(config.attention_backend)
    loaded = load_model(
        model_path, config.weight_format, attention, kernels.use_kernels(config.kernels), tp, config.max_model_len
    )
    num_blocks = int(tp.broadcast(torch.zeros(1, dtype=torch.int64), idle=True))
    kv = KVCacheManager(num_blocks, config.block_size, False)
    runner = ModelRunner(loaded.model, kv, tp, kv_dtype=KV_DTYPES[config.kv_cache_dtype])
    while (lists := wire.receive_lists(tp)) is not None:
        runner.run(StepInputs.from_wire(lists))


def _make_kv_manager(
    config: EngineConfig, spec: ModelSpec, num_blocks: int, world_size: int, disk: DiskTier | None
) -> KVCacheManager:
    """The engine's KV manager. ``num_blocks``: the pool size as if every layer held whole contexts (the
    ``num_kv_blocks`` option, or what ``kv_cache_memory_gb`` holds). ``disk``: the disk tier, if any.

    A model with sliding-window layers (Gemma 3) gets a :class:`HybridKVCacheManager`: its windowed layers hold
    only each request's last window, in a pool of their own, so the memory they would have spent on whole
    contexts goes to the full-attention layers instead (docs/sliding-window.md). Every other model gets the
    plain :class:`KVCacheManager`, unchanged.
    """
    windows = [w for w in spec.layer_windows if w]
    if not windows:
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, disk)
    if world_size > 1 or config.kv_cache_dir is not None:
        logger.info(
            "sliding-window layers keep every block of a request here (tensor parallelism and kv_cache_dir do not "
            "take the windowed block group yet): KV memory is that of full attention"
        )
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, disk)
    window = max(windows)  # blocks kept for the widest window serve every narrower one
    num_full_layers = spec.num_layers - len(windows)
    if config.num_kv_blocks is not None:
        full_blocks = window_blocks = num_blocks
    else:
        need = window_group_need(window, config.block_size, config.max_num_seqs, config.max_num_batched_tokens)
        full_blocks, window_blocks = split_kv_budget(num_blocks * spec.num_layers, num_full_layers, len(windows), need)
    return HybridKVCacheManager(full_blocks, config.block_size, config.enable_prefix_caching, window, window_blocks)


def _open_disk_tier(config: EngineConfig, loaded: LoadedModel, use_kernels: bool, kv_dtype: torch.dtype) -> DiskTier:
    """The prefix cache's disk tier in ``config.kv_cache_dir``, under this engine's fingerprint."""
    directory = Path(config.kv_cache_dir).expanduser()
    fingerprint, covers = engine_fingerprint(
        loaded.path,
        directory / "models",
        weight_format=loaded.weight_format,
        kernels=use_kernels,
        gemm=use_kernels and kernels.gemm.loaded,
        attention=loaded.model.attention.name,
        block_size=config.block_size,
        kv_dtype=kv_dtype,
    )
    logger.info("kv_cache_dir %s: fingerprint %s over %s", directory, fingerprint[:16], covers)
    return DiskTier(directory, fingerprint, int(config.kv_cache_disk_gb * 2**30))


def _log_ready(config: EngineConfig, runner: ModelRunner, path: str, max_model_len: int, use_kernels: bool) -> None:
    logger.info(
        "engine ready: %s, %d KV blocks of %d tokens (%s, %.2f GiB), max_model_len %d, attention %s, kernels %s",
        path,
        runner.kv.num_total_blocks,
        config.block_size,
        config.kv_cache_dtype,
        sum(k.nbytes + v.nbytes for k, v in runner.kv_caches) / 2**30,
        max_model_len,
        runner.model.attention.name,
        use_kernels,
    )
