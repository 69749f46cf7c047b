"""Rotary position embedding (RoPE): one cos/sin table per model, applied to q and k in one pass.

The table is built once, up to the model's maximum position, so a step only indexes it by ``positions``
(once per forward, shared by every layer). Heads use the "rotate half" layout of HF Llama checkpoints
(pairs ``(i, i + D/2)``), which lets the rotation be written as ``x * cos + roll(x, D/2) * sin_signed``
with ``sin_signed = [-sin, sin]``: four tensor ops for q and k together instead of a split, negate and
concatenate per tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """``{"rope_type", "rope_theta", ...scaling keys}`` from a transformers 4 or 5 config.

    transformers 5 keeps everything in ``config.rope_parameters``; older configs use ``rope_theta`` plus an
    optional ``rope_scaling`` dict (whose type key was once called ``type``).
    """
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    params = {**legacy, **(getattr(hf_config, "rope_parameters", None) or {})}  # the newer keys win
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> Tensor:
    """``[head_dim / 2]`` fp32 angular frequencies, with linear or Llama-3 context scaling applied."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}): "
            "use a model without that RoPE scaling"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: Tensor, params: dict[str, Any]) -> Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between.

    Wavelengths are compared to the original training context: below ``context / high_freq_factor`` the
    frequency is untouched, above ``context / low_freq_factor`` it is divided by ``factor``, and in between
    the two are mixed linearly in ``context / wavelength``.
    """
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    context = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    smooth = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelength > context / low, inv_freq / factor, blended)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed ``cos`` and signed ``sin`` tables, ``[max_positions, head_dim]`` each, fp32."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = inverse_frequencies(head_dim, params)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin_signed", torch.cat([-sin, sin], dim=-1), persistent=False)

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``cos, sin_signed`` rows of ``positions [T]``, as ``[T, 1, head_dim]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate ``x [T, H, D]`` (q and k heads side by side work too); returns a new tensor."""
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rotated, sin_signed)
