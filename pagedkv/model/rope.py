"""Rotary position embedding (RoPE): one cos/sin table per model, applied to q and k in one pass.

The table is built once, one row per position the engine can reach (its ``max_model_len``: no request is
longer), so a step only indexes it by ``positions`` (once per forward, shared by every layer). Sized by the
model's ``max_position_embeddings`` instead, a 131k-position Phi-3 config's two tables took ~100 MB however
short the engine's limit. Heads use the "rotate half" layout of HF Llama checkpoints
(pairs ``(i, i + D/2)``), which lets the rotation be written as ``x * cos + roll(x, D/2) * sin_signed``
with ``sin_signed = [-sin, sin]``: four tensor ops for q and k together instead of a split, negate and
concatenate per tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pagedkv import kernel_ops
from pagedkv.model.rope_scaling import rope_frequencies


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """``{"rope_type", "rope_theta", ...scaling keys}`` from a transformers 4 or 5 config.

    transformers 5 keeps everything in ``config.rope_parameters``; older configs use ``rope_theta`` plus an
    optional ``rope_scaling`` dict (whose type key was once called ``type``).
    """
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    params = {**legacy, **(getattr(hf_config, "rope_parameters", None) or {})}  # the newer keys win
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    original = getattr(hf_config, "original_max_position_embeddings", None)  # Phi-3 keeps it beside the scaling
    if original is not None and params["rope_type"] != "default":  # and there it wins, as in HF
        params["original_max_position_embeddings"] = original
    return params


class RotaryEmbedding(torch.nn.Module):
    """Precomputed ``cos`` and signed ``sin`` tables, ``[num_positions, rotary_dim]`` each, fp32, already
    multiplied by the scaling's attention factor (as HF multiplies its cos and sin).

    ``rotary_dim``: how many leading dimensions of each head RoPE rotates (Phi-4-mini's
    ``partial_rotary_factor`` rotates 3/4 of them; the rest pass through unrotated). ``num_positions``: the
    table's rows, the engine's ``max_model_len``. ``max_position_embeddings``: the config's, which longrope's
    frequencies and attention factor depend on whatever the table's length (rope_scaling.py)."""

    def __init__(
        self, rotary_dim: int, num_positions: int, params: dict[str, Any], max_position_embeddings: int
    ) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"RoPE needs an even number of rotated dimensions, got {rotary_dim}")
        if not 0 < num_positions <= max_position_embeddings:
            raise ValueError(
                f"a RoPE table of {num_positions} positions: it needs 1 to max_position_embeddings "
                f"({max_position_embeddings}) rows"
            )
        self.rotary_dim = rotary_dim
        inv_freq, attention_factor = rope_frequencies(rotary_dim, params, max_position_embeddings)
        angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin_signed", torch.cat([-sin, sin], dim=-1), persistent=False)

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``cos, sin_signed`` rows of ``positions [T]``, as ``[T, 1, head_dim]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate ``x [T, H, D]`` (q and k heads side by side work too); returns a new tensor."""
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rotated, sin_signed)


def rotate_heads(qk: Tensor, cos: Tensor, sin_signed: Tensor, rotary_dim: int, compiled: bool) -> Tensor:
    """RoPE on the first ``rotary_dim`` dimensions of every head of ``qk [T, H, D]`` (all of them, but for a partial
    rotary factor such as Phi-4-mini's: the rest pass unrotated, as in HF); ``compiled``: the C++ kernel rotates
    them in place (a strided view of each head works). Returns the rotated heads."""
    rotated = qk if rotary_dim == qk.shape[-1] else qk[..., :rotary_dim]
    if compiled and rotated.stride(-1) == 1:
        kernel_ops.rope_(rotated, cos, sin_signed)
        return qk
    if rotated is qk:
        return apply_rope(qk, cos, sin_signed)
    return torch.cat([apply_rope(rotated, cos, sin_signed), qk[..., rotary_dim:]], dim=-1)
