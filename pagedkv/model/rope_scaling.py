"""RoPE context scaling: the inverse frequencies and cos/sin factor of each ``rope_type`` pagedkv computes.

A long-context checkpoint stretches RoPE beyond the positions it was pre-trained on by changing the angular
frequency of each rotated pair, and some types also scale cos and sin by an "attention factor" (equivalent to
sharpening the softmax, since both q and k are rotated). Each function below follows the formula of the
paper its type comes from, in the fp32 operations HF transformers uses, so the tables match its own
(``tests/model/test_rope_scaling.py`` compares them with ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``).

``longrope`` (Phi-3 128k, Phi-3.5, Phi-4-mini) has two sets of per-pair factors, short and long. HF picks
the set anew at every forward from the longest position in it, so K cached while a sequence was short
would be rotated differently from K written once it is long: a prefix-cache hit, or the same prompt in a
batch with a longer one, would change the numbers. pagedkv decides once per engine, as vLLM does: the long
factors when the engine's ``max_model_len`` exceeds ``original_max_position_embeddings``, else the short
ones (``long_context`` in the parameters, set by ``ModelSpec``); every position of every request then has
one rotation.

``dynamic`` NTK scaling changes with the sequence length in the same way and has no such rule in its
checkpoints' configs: it is refused, by name, with the other unknown types.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_frequencies(rotary_dim: int, params: dict[str, Any], max_positions: int) -> tuple[Tensor, float]:
    """``[rotary_dim / 2]`` fp32 angular frequencies and the factor cos and sin are multiplied by.

    ``params``: the RoPE parameters (``rope_type``, ``rope_theta`` and the type's own keys); ``max_positions``:
    the config's ``max_position_embeddings``, from which longrope infers its ``factor`` when the config has none."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES}): "
            "use a model without that RoPE scaling"
        )
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    if rope_type == "yarn":
        return _yarn(base**exponents, rotary_dim, base, params)
    if rope_type == "longrope":
        return _longrope(base**exponents, params, max_positions)
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, params), 1.0
    return inv_freq, 1.0


def llama3_inv_freq(inv_freq: Tensor, params: dict[str, Any]) -> Tensor:
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


def _yarn(wavelength_base: Tensor, rotary_dim: int, base: float, params: dict[str, Any]) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): pairs that turn fewer than ``beta_slow`` times over the original context are
    interpolated (frequency / ``factor``), those turning more than ``beta_fast`` times are kept, and a linear
    ramp over the pair index blends the two between; cos and sin are scaled by ``0.1 ln(factor) + 1``
    (or the ``mscale`` / ``mscale_all_dim`` ratio, or ``attention_factor`` when the config gives one)."""
    original, factor = float(params["original_max_position_embeddings"]), float(params["factor"])
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def pair_index(rotations: float) -> float:
        """The (fractional) pair index whose wavelength fits ``rotations`` times into the original context."""
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero: a step, as the reference implementation makes it
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled ("extrapolated") frequency per pair
    inv_freq = 1.0 / (factor * wavelength_base) * (1 - keep) + 1.0 / wavelength_base * keep
    return inv_freq, float(attention)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope(wavelength_base: Tensor, params: dict[str, Any], max_positions: int) -> tuple[Tensor, float]:
    """LongRoPE (Ding et al. 2024): each pair's frequency divided by its own searched factor, from the long or
    the short set (``params["long_context"]``, see the module docstring); cos and sin scaled by
    ``sqrt(1 + ln(factor) / ln(original context))`` unless the config gives ``attention_factor``."""
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = params["long_factor" if params["long_context"] else "short_factor"]
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * wavelength_base), float(attention)


def check_rope(params: dict[str, Any], rotary_dim: int) -> str | None:
    """What is wrong with ``params`` for a head rotating ``rotary_dim`` dimensions (None: nothing), naming the
    field to change; checked once, when the model description is read."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
    needed = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings"),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    }.get(rope_type, ())
    missing = [key for key in needed if params.get(key) is None]
    if missing:
        return f"rope_type {rope_type!r} needs {missing} in rope_parameters (rope_scaling)"
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != rotary_dim // 2:
                return f"{key} has {len(params[key])} values, one per rotated pair ({rotary_dim // 2}) is needed"
    return None
