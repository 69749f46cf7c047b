"""A tensor-parallel worker's life (ranks 1..N-1), beside the runner it builds: parallel/workers.py starts the
rank and hands it this ``serve``, so the comms room never builds a model. A worker holds no scheduler, no KV
manager state and no sampler: it runs the flat steps rank 0 broadcasts."""

from __future__ import annotations

import torch
import transformers

from pagedkv import kernels
from pagedkv.attention.backend import select_backend
from pagedkv.config import EngineConfig
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.step_inputs import StepInputs
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.ops import KV_DTYPES
from pagedkv.model.loader import load_model, model_directory
from pagedkv.model.spec import ModelSpec
from pagedkv.parallel import wire
from pagedkv.parallel.group import TensorParallel


def check_divides(model_path: str, world: int, exact: bool) -> None:
    """Refuse a size that does not split the heads and the MLP, before any process starts."""
    spec = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(model_directory(model_path)))
    tp = TensorParallel(0, world)
    tp.split(spec.num_heads, "query heads")
    tp.split(spec.num_kv_heads, "KV heads")
    tp.split(spec.intermediate_size, "MLP width")
    if exact:
        tp.split(spec.hidden_size, "hidden size")


def serve(tp: TensorParallel, config: EngineConfig, model_path: str) -> None:
    """Load the shard, size the pool as rank 0 says, run steps until told to stop."""
    attention = select_backend(config.attention_backend)
    loaded = load_model(
        model_path, config.weight_format, attention, kernels.use_kernels(config.kernels), tp, config.max_model_len
    )
    num_blocks = int(tp.broadcast(torch.zeros(1, dtype=torch.int64), idle=True))
    kv = KVCacheManager(num_blocks, config.block_size, False)
    runner = ModelRunner(loaded.model, kv, tp, kv_dtype=KV_DTYPES[config.kv_cache_dtype])
    while (lists := wire.receive_lists(tp)) is not None:
        runner.run(StepInputs.from_wire(lists))
