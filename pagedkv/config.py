"""EngineConfig: every knob of the engine in one validated dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

DTYPES = ("float32", "bfloat16", "q4")
ATTENTION_BACKENDS = ("kernel", "gather")
LINEAR_BACKENDS = ("panel", "torch")


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; `LLM(**kwargs)` and the CLI fill this.

    `num_kv_blocks=None` sizes the pool from `kv_cache_memory_gb`. `max_model_len=None` takes the model's
    own context length. `attention_backend=None` means: `$PAGEDKV_ATTENTION_BACKEND` if set, else the
    compiled kernel when it builds, else the gather path. `linear_backend=None` likewise means
    `$PAGEDKV_LINEAR_BACKEND`, else the compiled panel GEMM (and RMSNorm) when it builds,
    else torch's GEMM everywhere. `dtype="q4"` reads the GGUF file's exact 4-/8-bit codes and needs the
    panel GEMM. `num_speculative_tokens=k > 0` lets greedy requests guess up to k tokens a step from their
    own history (prompt lookup, see `pagedkv.engine.speculative`); outputs stay greedy's.
    """

    model: str | None = None
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    linear_backend: str | None = None
    num_speculative_tokens: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 (or None to size it automatically), got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS} or None, got {self.attention_backend!r}"
            )
        if self.linear_backend is not None and self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS} or None, got {self.linear_backend!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be an int >= 0 (0 = off), got {self.num_speculative_tokens!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def cache_root() -> Path:
    """Root of pagedkv's per-machine caches (converted models, the compiled kernel).

    ``$PAGEDKV_CACHE_DIR`` if set, else ``~/.cache/pagedkv``.
    """
    override = os.environ.get("PAGEDKV_CACHE_DIR")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "pagedkv"
