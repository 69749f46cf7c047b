"""A GGUF file's tensors under the Hugging Face names the model loads, in the row order HF uses.

llama.cpp names tensors its own way (``blk.3.attn_q.weight`` for ``model.layers.3.self_attn.q_proj.weight``)
and, for the ``llama`` architecture, stores the rows of q and k interleaved per head (its converter permutes
them for its own RoPE layout): :func:`hf_tensors` renames every tensor and puts those rows back, moving
whole rows of ggml blocks, so nothing is de-quantised. A tensor it does not know is refused by name: an
unknown tensor is a part of the model the engine would silently leave out.

``gemma3`` files name Gemma's four norms a layer their own way (``ffn_norm`` is the MLP's input norm there, not
the attention output's) and hold every norm weight as ``1 + w`` (llama.cpp's converter adds the 1): the norms
are handed on as HF's ``w``, ``(1 + w) - 1`` in fp32 as transformers computes it, and the model adds the 1 back.

``phi3`` files keep q|k|v and gate|up fused (``attn_qkv``; ``ffn_up`` holds gate and up), as HF's checkpoints
do. RoPE factor tensors (``rope_freqs``, ``rope_factors_*``) are not weights: ``gguf_rope`` reads them into
the config.

:class:`DequantizedTensors` is the other way in: every tensor de-quantised to fp32 when the loader asks for it,
for ``weight_format="float32"`` / ``"bfloat16"`` (the reference) and where the compiled kernels are unavailable.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as numpy_dequantize
from torch import Tensor

from pagedkv import kernels
from pagedkv.model import gguf_blocks
from pagedkv.model.gguf_file import GGUFError, GGUFFile, GGUFTensor
from pagedkv.model.gguf_rope import ROPE_TENSORS

logger = logging.getLogger(__name__)

# GGUF architecture -> the HF model_type its config converts to (transformers' GGUF support does the converting)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3"}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# per architecture, the layer parts named differently from llama's
_LAYER_BY_ARCHITECTURE = {
    "gemma3": {
        **_LAYER,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_NORMS_PLUS_ONE = {"gemma3"}  # architectures whose files hold norm weights as 1 + w
_LAYER_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>[a-z_]+)\.(?P<kind>weight|bias)$")


def check_architecture(gguf: GGUFFile) -> None:
    """Refuse a file of an architecture pagedkv does not run, before its metadata is converted."""
    if gguf.architecture not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf.path}: architecture {gguf.architecture!r} is not supported: pagedkv runs GGUF files of "
            f"{sorted(ARCHITECTURES)}"
        )


def hf_tensors(gguf: GGUFFile, num_heads: int, num_kv_heads: int) -> dict[str, GGUFTensor]:
    """Every tensor of ``gguf`` by its HF name, llama's q/k rows in HF order; raises on a tensor it does not know."""
    renamed: dict[str, GGUFTensor] = {}
    layer_parts = _LAYER_BY_ARCHITECTURE.get(gguf.architecture, _LAYER)
    for name, tensor in gguf.tensors.items():
        if name in ROPE_TENSORS:
            continue
        hf_name = _GLOBAL.get(name)
        match = _LAYER_NAME.match(name)
        if match is not None and match["part"] in layer_parts:
            hf_name = f"model.layers.{match['layer']}.{layer_parts[match['part']]}.{match['kind']}"
        if hf_name is None:
            raise GGUFError(f"{gguf.path}: tensor {name!r} is not part of a {gguf.architecture} model pagedkv knows")
        if gguf.architecture == "llama" and match is not None and match["part"] in ("attn_q", "attn_k"):
            heads = num_heads if match["part"] == "attn_q" else num_kv_heads
            tensor = tensor.take_rows(_hf_row_order(tensor.shape[0], heads))
        if gguf.architecture in _NORMS_PLUS_ONE and hf_name.endswith("norm.weight"):
            tensor = _minus_one(tensor)
        renamed[hf_name] = tensor
    return renamed


def _minus_one(tensor: GGUFTensor) -> GGUFTensor:
    """A norm weight stored as ``1 + w``, as ``w`` (fp32)."""
    values = (dequantize(tensor) - 1.0).contiguous()
    return GGUFTensor(
        tensor.name, GGMLQuantizationType.F32, tensor.shape, values.view(torch.uint8).view(1, -1), tensor.file
    )


def _hf_row_order(rows: int, heads: int) -> Tensor:
    """GGUF row of each HF row of a llama q or k projection.

    llama.cpp's converter stores head ``h``'s rows ``(t, j)`` (``t`` in 0..1 picks the half of the head, ``j``
    its row within the half) at ``(j, t)``, so that RoPE rotates adjacent pairs; HF rotates the halves."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def dequantize(tensor: GGUFTensor) -> Tensor:
    """``tensor`` as fp32, exactly as ggml de-quantises it: compiled where the library builds, else numpy's."""
    n = tensor.data.shape[0]
    if tensor.ggml_type in gguf_blocks.TYPES and kernels.portable.available():
        values = gguf_blocks.dequantize(tensor.data, tensor.ggml_type, n, tensor.k)
    else:
        values = torch.from_numpy(np.asarray(numpy_dequantize(tensor.data.numpy(), tensor.ggml_type)).copy())
    return values.reshape(tensor.shape)


def dequantize_without_kernel(tensor: GGUFTensor) -> Tensor:
    """A tensor of a type the GEMM has no format for (the i-quants, ternary, fp4 types) de-quantised once to fp32,
    with a warning that names it and what it costs, so it is never a silent 4-bytes-a-weight surprise."""
    values = dequantize(tensor)
    logger.warning(
        "%s: tensor %r is %s, which pagedkv has no kernel for: de-quantised once to fp32 (%.1f MiB instead of "
        "the file's %.1f MiB)",
        tensor.file,
        tensor.name,
        tensor.type_name,
        values.nbytes / 2**20,
        tensor.data.nbytes / 2**20,
    )
    return values


class DequantizedTensors(Mapping):
    """``HF name -> fp32 tensor``, each de-quantised when asked for (the loader asks once, layer by layer)."""

    def __init__(self, tensors: Mapping[str, GGUFTensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> Tensor:
        return dequantize(self._tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class NativeTensors(DequantizedTensors):
    """The linear layers' and the embedding's tensors as they are in the file (the model packs their codes for
    the panel GEMM), everything else (norms, biases) de-quantised to fp32."""

    def __getitem__(self, name: str) -> Tensor | GGUFTensor:
        tensor = self._tensors[name]
        return tensor if len(tensor.shape) == 2 else dequantize(tensor)


def check_vocabulary(gguf: GGUFFile, tensors: Mapping[str, GGUFTensor], vocab_size: int) -> None:
    """The embedding (and LM head) must have one row per token of the config's vocabulary."""
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensor = tensors.get(name)
        if tensor is not None and tensor.shape[0] != vocab_size:
            raise GGUFError(
                f"{gguf.path}: tensor {tensor.name!r} has {tensor.shape[0]} rows but the vocabulary has "
                f"{vocab_size} tokens: the file is inconsistent"
            )
