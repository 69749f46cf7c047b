"""ModelSpec: the handful of numbers and switches that tell the Llama family's members apart.

Llama, SmolLM2 and Mistral share one decoder; Qwen2 adds biases to the q/k/v projections, Qwen3 adds a
per-head RMSNorm on q and k before RoPE. Reading them from the HF config in one place keeps the model code
free of ``getattr`` chains and makes unsupported configs fail early with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.model.rope import rope_parameters

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_positions: int  # size of the RoPE table: the model's max_position_embeddings
    max_model_len: int  # longest context computed exactly (a sliding window, if any, caps it)
    rope: dict[str, Any]

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported: pagedkv runs {SUPPORTED_MODEL_TYPES} models")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"only SwiGLU MLPs (hidden_act='silu') are supported, the config has {act!r}")
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} must be a multiple of num_key_value_heads {num_kv_heads}"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        max_positions = int(config.max_position_embeddings)
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            max_positions=max_positions,
            max_model_len=min(max_positions, _sliding_window(config) or max_positions),
            rope=rope_parameters(config),
        )


def _sliding_window(config: Any) -> int | None:
    """The attention window, if the config turns one on (Mistral v0.1; Qwen with use_sliding_window).

    Within the window, windowed and full attention agree, so the engine stays exact by capping the
    context length at the window instead of implementing windowed attention.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)
