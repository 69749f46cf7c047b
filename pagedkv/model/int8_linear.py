"""``weight_format="gguf-int8"``: llama.cpp's arithmetic on a GGUF file's codes (``csrc/int8_linear.cpp``).

The exact default (``"gguf"``) de-quantises every weight to fp32 in registers and multiplies in fp32: the same
logits as HF transformers loading the file, at the price of fp32 arithmetic on every weight. This format trades
that exactness for llama.cpp's speed: each step's activations are rounded per block to int8 codes with one
scale (Q8_K per 256 values for the K-quants, Q8_0 / Q8_1 per 32 for the legacy types, as ggml's quantisers make
them), and dotted in integers with the weights' own codes, the scales applied once per block as ggml's vec_dot
kernels do. What it gives up: logits carry the activations' rounding (about 1/254 of a block's largest value
per activation), so they are no longer bit-equal to HF's, and greedy output can differ where two tokens are
close. What it keeps: a row's result does not depend on the other rows of its batch (the Determinism section
of DESIGN.md).

Every type is repacked at load, in one pass in C++ over the file's bytes, into groups of 16 output rows
(``csrc/int8_repack.h``), the layout of the tiled kernel (``csrc/int8_tiled.h``) that makes a 32-row GEMM several
times faster than on the file's row-major blocks; the copy is about the file tensor's size (per column-block,
repacked / file: Q4_K 148 / 144 bytes, Q6_K 212 / 210, Q8_0 36 / 34, Q5_0 24 / 22, Q4_0 20 / 18, Q4_1 20 / 20),
and the file's pages are let go after each layer, so a process holds the repacked copy, not the file (measured:
643 MiB of repacked weights from a 684 MiB Q4_K_M file, peak RSS below the exact format's;
docs/int8-activations.md).

Types with an int8 kernel: :data:`REPACKED` (those of a Q4_K_M file, and Q4_0 / Q4_1). A tensor of any other type
stays on the exact path (packed for the panel GEMM), with a log line naming it.
"""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType as T
from torch import Tensor

from pagedkv import kernels
from pagedkv.model.gguf_file import GGUFTensor
from pagedkv.model.panel import INT8_FORMATS, INT8_REPACKED_BASE, PanelWeight

logger = logging.getLogger(__name__)

WEIGHT_FORMAT = "gguf-int8"
# the types with an int8 kernel, each repacked at load for it: ggml type -> format name
REPACKED = {int(t): f"int8-{t.name.lower()}-x16" for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K)}
assert all(INT8_FORMATS[name] == INT8_REPACKED_BASE + t for t, name in REPACKED.items())


def weight(tensor: GGUFTensor) -> PanelWeight | None:
    """``tensor`` for the int8-activation GEMM, repacked (:func:`repack`); None (with an info line naming the
    tensor) for a type it has no kernel for, which the caller then computes exactly."""
    if tensor.ggml_type not in REPACKED:
        logger.info(
            "%s: tensor %r is %s, which has no int8-activation kernel: it is computed exactly (fp32)",
            tensor.file,
            tensor.name,
            tensor.type_name,
        )
        return None
    return repack(tensor.data, tensor.shape[0], tensor.k, tensor.ggml_type)


def repack(blocks: Tensor, n: int, k: int, ggml_type: int) -> PanelWeight:
    """``blocks`` of a type of :data:`REPACKED` (the file's bytes, ``[n, row bytes]``) repacked in groups of 16
    outputs for the tiled kernel (``csrc/int8_repack.h``): one pass in C++, the file's bytes read once."""
    kernels.gemm.require("gguf-int8 repacks its weights with them")
    fmt = REPACKED[int(ggml_type)]
    packed = torch.ops.pagedkv.int8_repack(blocks.contiguous(), n, k, INT8_FORMATS[fmt])
    return PanelWeight(packed, n, k, fmt)
