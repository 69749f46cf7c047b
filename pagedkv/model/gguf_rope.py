"""The RoPE a GGUF file holds where transformers' GGUF conversion does not look, put into the converted config.

transformers turns a file's metadata into an HF config, but for the architectures pagedkv runs it reads only
``rope.freq_base``: long-context scaling, which llama.cpp's converter stores as keys and tensors, would be
silently left out, and a Llama 3.2 or Phi-3.5 file would run with plain RoPE. :func:`complete_config` reads it:

- ``rope_freqs.weight`` (Llama 3.1-3.3): llama.cpp's converter bakes the ``llama3`` scaling into one divisor a
  rotated pair, from ``factor``, ``low_freq_factor``, ``high_freq_factor`` and the original context, and
  keeps no key for them. Every Llama 3.x checkpoint uses 1, 4 and 8,192 for the last three and ``factor`` is
  the largest divisor: the parameters are taken as those when they give back the file's divisors exactly
  (to fp32 rounding), and the file is refused, naming the tensor, when they do not.
- ``{arch}.rope.scaling.type`` (linear, yarn set by hand on a Llama or Qwen file): refused, naming the key.
- ``phi3`` files: the rotated dimensions (``rope.dimension_count``: Phi-4-mini's partial rotary), the
  original context, the window, and for longrope its attention factor and the two factor sets as the
  ``rope_factors_long`` / ``rope_factors_short`` tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from pagedkv.model.gguf_file import GGUFError, GGUFFile
from pagedkv.model.rope_scaling import llama3_inv_freq

LLAMA3_FREQS = "rope_freqs.weight"
_LONGROPE = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
ROPE_TENSORS = frozenset({LLAMA3_FREQS, *_LONGROPE.values()})  # read into the config, not weights
_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def complete_config(gguf: GGUFFile, config: Any) -> None:
    """Set in ``config`` (transformers' conversion of ``gguf``'s metadata) the RoPE that conversion leaves out."""
    scaling = gguf.metadata.get(f"{gguf.architecture}.rope.scaling.type")
    if scaling not in (None, "none") and gguf.architecture != "phi3":
        raise GGUFError(
            f"{gguf.path}: {gguf.architecture}.rope.scaling.type={scaling!r}: pagedkv does not read RoPE scaling "
            "from a GGUF file's keys (nor does transformers' conversion); run the model's HF directory, whose "
            "config.json rope_scaling it reads"
        )
    if gguf.architecture == "phi3":
        _phi3(gguf, config)
    if LLAMA3_FREQS in gguf.tensors:
        _llama3(gguf, config)


def _values(gguf: GGUFFile, name: str) -> list[float]:
    tensor = gguf.tensors[name]
    return np.asarray(dequantize(tensor.data.numpy(), tensor.ggml_type), dtype=np.float32).reshape(-1).tolist()


def _llama3(gguf: GGUFFile, config: Any) -> None:
    divisors = torch.tensor(_values(gguf, LLAMA3_FREQS))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = float(config.rope_parameters["rope_theta"])
    params = {"rope_type": "llama3", "rope_theta": base, "factor": float(divisors.max()), **_LLAMA3}
    inv_freq = (1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))).double()
    expected = (inv_freq / llama3_inv_freq(inv_freq, params)).float()  # each pair's divisor, as the file holds
    if divisors.shape != expected.shape or not torch.allclose(expected, divisors, rtol=1e-6):
        raise GGUFError(
            f"{gguf.path}: tensor {LLAMA3_FREQS!r} does not hold Llama 3's RoPE scaling (low_freq_factor 1, "
            "high_freq_factor 4, original context 8192): pagedkv does not read other per-pair RoPE divisors"
        )
    config.rope_parameters = params


def _phi3(gguf: GGUFFile, config: Any) -> None:
    meta, head_dim = gguf.metadata, config.hidden_size // config.num_attention_heads
    rotary_dim = int(meta.get("phi3.rope.dimension_count", head_dim))
    params = dict(config.rope_parameters, rope_type="default", partial_rotary_factor=rotary_dim / head_dim)
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        config.original_max_position_embeddings = int(original)
    present = [name for name in _LONGROPE.values() if name in gguf.tensors]
    if present:
        if len(present) != len(_LONGROPE) or original is None:
            raise GGUFError(
                f"{gguf.path}: longrope needs both {sorted(_LONGROPE.values())} tensors and the key "
                f"phi3.rope.scaling.original_context_length; the file has {present}: it is incomplete"
            )
        params.update({key: _values(gguf, name) for key, name in _LONGROPE.items()})
        params.update(rope_type="longrope", original_max_position_embeddings=int(original))
        if "phi3.rope.scaling.attn_factor" in meta:
            params["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
    config.rope_parameters = params
    config.sliding_window = int(meta.get("phi3.attention.sliding_window", 0)) or None
