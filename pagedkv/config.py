"""EngineConfig: every knob of the engine in one validated dataclass.

Each field's ``metadata["help"]`` says what it does, for the CLI options generated from the fields; where
only some values are allowed, ``metadata["choices"]`` lists them, here so that reading the config loads
neither torch nor the implementations, which key their tables by these names (tests/config/test_config.py checks).
``dtype`` and ``linear_backend`` are the old names of ``weight_format`` and ``kernels``, kept for one
release: they warn and are mapped to the new fields, then read None.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Any

# keyed by model/layers.py (each format's dtype), kv/ops.py (each pool dtype) and attention/paged.py
WEIGHT_FORMATS = ("float32", "bfloat16", "gguf", "gguf-int8")
KV_CACHE_DTYPES = ("float32", "float16")
ATTENTION_BACKENDS = ("kernel", "gather")
MAX_TOKENS_POLICIES = ("reject", "clamp")

# old name -> (new name, old value -> new value)
_DEPRECATED = {
    "dtype": ("weight_format", {"float32": "float32", "bfloat16": "bfloat16", "q4": "gguf"}),
    "linear_backend": ("kernels", {"panel": True, "torch": False}),
}


def _option(default: Any, help: str, **metadata: Any) -> Any:
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; ``LLM(**kwargs)`` and the CLI fill this."""

    model: str | None = _option(None, "HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    weight_format: str | None = _option(
        None,
        "weights of the linear layers: gguf (the default for a .gguf file): fp32 math on the file's own codes "
        "(every common llama.cpp type), exactly the weights ggml de-quantises, packed from the mapped file; "
        "gguf-int8 (opt-in, .gguf only): llama.cpp's arithmetic, activations rounded to int8 blocks and dotted "
        "with the codes -- faster, not bit-equal to HF, still batch-invariant (docs/int8-activations.md); "
        "float32 (the default otherwise; for a .gguf file: de-quantised once, in memory, the reference); "
        "bfloat16 (pays on CPUs with bf16 GEMMs)",
        choices=WEIGHT_FORMATS,
    )
    block_size: int = _option(16, "tokens per KV block (a power of two)")
    num_kv_blocks: int | None = _option(None, "KV pool size in blocks (default: from kv_cache_memory_gb)")
    kv_cache_memory_gb: float = _option(1.0, "KV pool memory in GiB, used when num_kv_blocks is not given")
    kv_cache_dtype: str = _option(
        "float32",
        "element type of the KV pool: float32 (exact: the same tokens as HF transformers in fp32); float16 holds "
        "twice the tokens in the same memory (llama.cpp's default), each K/V value rounded to fp16 once, so "
        "outputs may differ slightly from fp32",
        choices=KV_CACHE_DTYPES,
    )
    max_num_seqs: int = _option(64, "most requests in one step")
    max_num_batched_tokens: int = _option(2048, "most tokens in one step (prompts are cut into chunks to fit)")
    max_prefill_tokens_with_decodes: int = _option(
        64,
        "most prompt tokens in one step while any request decodes (prompts are cut into smaller chunks then): "
        "every stream waits for the whole step, ~0.2-0.45 s at 64 on the default model on one core, ~6 s at "
        "2,048; a row deeper into its prompt costs more of it (engine/admission.py), so chunks shrink as the "
        "context grows and a step's time stays about level",
    )
    max_seq_share_per_request: float = _option(
        0.5,
        "most of the max_num_seqs running seats that one request (all its n samples) holds while other requests "
        "wait, as a fraction (0, 1] (at least one seat); seats over it go to the waiting requests",
    )
    max_model_len: int | None = _option(None, "longest context, prompt and output (default: the model's own)")
    max_tokens_policy: str = _option(
        "reject",
        "a request whose prompt + max_tokens exceeds max_model_len: reject (a ValueError; the server's 400, in "
        "vLLM's words) or clamp (generate until the context is full, finish_reason 'length')",
        choices=MAX_TOKENS_POLICIES,
    )
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of identical prompt prefixes")
    attention_backend: str | None = _option(
        None,
        "decode attention: the compiled kernel or gather + SDPA in torch (default: $PAGEDKV_ATTENTION_BACKEND, "
        "else the kernel if it builds)",
        choices=ATTENTION_BACKENDS,
    )
    kernels: bool | None = _option(
        None,
        "compiled ops for the linear layers (panel GEMM), RMSNorm, SiLU and RoPE; False runs torch's ops "
        "(default: $PAGEDKV_KERNELS, 1 or 0, else on where they build)",
    )
    num_speculative_tokens: int = _option(
        0, "tokens a greedy request may guess per step from its own history (prompt lookup; 0 = off)"
    )
    num_threads: int | None = _option(None, "torch threads (default: all cores; per rank with tensor parallelism)")
    tensor_parallel_size: int = _option(
        1,
        "processes the model is split across (Megatron-style tensor parallelism on torch.distributed, gloo; "
        "started on this machine, or by torchrun across machines); 1 = off",
    )
    tensor_parallel_exact: bool = _option(
        False,
        "with tensor parallelism: gather each row-parallel layer's input so every output keeps its one-process "
        "sum -- outputs bitwise equal to tensor_parallel_size=1, at two all-gathers per layer instead of one "
        "all-reduce",
    )
    kv_cache_dir: str | None = _option(
        None,
        "directory that keeps the prefix cache's full blocks across restarts (content-addressed safetensors "
        "files, keyed by the model's fingerprint); off by default",
    )
    kv_cache_disk_gb: float = _option(
        4.0, "size limit of kv_cache_dir in GiB; the least recently used blocks are deleted beyond it"
    )
    kv_events_endpoint: str | None = _option(
        None,
        "ZMQ address to publish KV cache events on, in vLLM's format, for KV-aware routers (e.g. "
        "tcp://127.0.0.1:5557 or ipc://$XDG_RUNTIME_DIR/pagedkv-kv-events; needs pyzmq); only loopback or an "
        "owner-only IPC socket unless kv_events_allow_remote; off by default",
    )
    kv_events_allow_remote: bool = _option(
        False,
        "let kv_events_endpoint be any address: the events carry the token ids of every prompt without a "
        "cache_salt, readable by whoever can connect (the socket has no authentication)",
    )
    chat_template: str | None = _option(
        None,
        "Jinja chat template file that replaces the model's own (read and compiled once, at start)",
    )
    dtype: str | None = _option(None, "deprecated: use weight_format ('q4' is now 'gguf')", deprecated=True)
    linear_backend: str | None = _option(None, "deprecated: use kernels (panel: True, torch: False)", deprecated=True)

    def __post_init__(self) -> None:
        self._map_deprecated()
        if self.weight_format is not None and self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"weight_format must be one of {WEIGHT_FORMATS} or None (by the model file), got {self.weight_format!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
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
        if not isinstance(self.max_prefill_tokens_with_decodes, int) or self.max_prefill_tokens_with_decodes < 1:
            raise ValueError(
                f"max_prefill_tokens_with_decodes must be an int >= 1, got {self.max_prefill_tokens_with_decodes!r}"
            )
        if not 0 < self.max_seq_share_per_request <= 1:
            raise ValueError(
                f"max_seq_share_per_request must be in (0, 1] (a fraction of max_num_seqs), "
                f"got {self.max_seq_share_per_request!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ValueError(f"max_tokens_policy must be one of {MAX_TOKENS_POLICIES}, got {self.max_tokens_policy!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS} or None, got {self.attention_backend!r}"
            )
        if self.kernels is not None and not isinstance(self.kernels, bool):
            raise ValueError(f"kernels must be True, False or None (on where they build), got {self.kernels!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be an int >= 0 (0 = off), got {self.num_speculative_tokens!r}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1 (1 = off), got {self.tensor_parallel_size!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not self.kv_cache_disk_gb > 0:
            raise ValueError(f"kv_cache_disk_gb must be > 0, got {self.kv_cache_disk_gb}")
        if self.kv_cache_dir is not None:
            if not isinstance(self.kv_cache_dir, str) or not self.kv_cache_dir:
                raise ValueError(f"kv_cache_dir must be a directory path (or None), got {self.kv_cache_dir!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_cache_dir keeps the prefix cache on disk: it needs enable_prefix_caching=True")
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "kv_cache_dir does not support tensor_parallel_size > 1 yet (each rank holds a shard of every "
                    "block): drop one of the two"
                )

    def _map_deprecated(self) -> None:
        """``dtype`` -> ``weight_format``, ``linear_backend`` -> ``kernels``, with a DeprecationWarning each."""
        for old, (new, values) in _DEPRECATED.items():
            value = getattr(self, old)
            if value is None:
                continue
            if value not in values:
                raise ValueError(f"{old} must be one of {tuple(values)}, got {value!r}: better, use {new}")
            message = f"{old}={value!r} is deprecated: use {new}={values[value]!r}"
            warnings.warn(message, DeprecationWarning, stacklevel=4)  # past __post_init__, __init__: the caller
            if getattr(self, new) not in (EngineConfig.__dataclass_fields__[new].default, values[value]):
                raise ValueError(f"{old}={value!r} contradicts {new}={getattr(self, new)!r}: drop {old}")
            setattr(self, new, values[value])
            setattr(self, old, None)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
