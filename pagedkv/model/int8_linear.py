"""``weight_format="gguf-int8"``: llama.cpp's arithmetic on a GGUF file's blocks (``csrc/int8_linear.cpp``).

The exact default (``"gguf"``) de-quantises every weight to fp32 in registers and multiplies in fp32: the same
logits as HF transformers loading the file, at the price of fp32 arithmetic on every weight. This format trades
that exactness for llama.cpp's speed: each step's activations are rounded per block to int8 codes with one
scale (Q8_K per 256 values for the K-quants, Q8_0 / Q8_1 per 32 for the legacy types, as ggml's quantisers make
them), and dotted in integers with the weights' own codes, the scales applied once per block as ggml's vec_dot
kernels do. What it gives up: logits carry the activations' rounding (about 1/254 of a block's largest value
per activation), so they are no longer bit-equal to HF's, and greedy output can differ where two tokens are
close. What it keeps: a row's result does not depend on the other rows of its batch (the Determinism section
of DESIGN.md), and the weights are read in place from the memory-mapped file (nothing is repacked).

Types with an int8 kernel: :data:`TYPES` (those of a Q4_K_M file, and Q4_0 / Q4_1). A tensor of any other type
stays on the exact path (packed for the panel GEMM), with a log line naming it.
"""

from __future__ import annotations

import logging

from gguf import GGMLQuantizationType as T

from pagedkv.model.gguf_file import GGUFTensor
from pagedkv.model.panel import INT8_FORMAT_BASE, INT8_FORMATS, PanelWeight

logger = logging.getLogger(__name__)

WEIGHT_FORMAT = "gguf-int8"
TYPES = {int(t): f"int8-{t.name.lower()}" for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K)}
assert all(INT8_FORMATS[name] == INT8_FORMAT_BASE + t for t, name in TYPES.items())


def weight(tensor: GGUFTensor) -> PanelWeight | None:
    """``tensor``'s blocks as they are in the file, for the int8-activation GEMM; None (with an info line naming
    the tensor) for a type it has no kernel for, which the caller then computes exactly."""
    name = TYPES.get(tensor.ggml_type)
    if name is None:
        logger.info(
            "%s: tensor %r is %s, which has no int8-activation kernel: it is computed exactly (fp32)",
            tensor.file, tensor.name, tensor.type_name,
        )
        return None
    return PanelWeight(tensor.data.contiguous(), tensor.shape[0], tensor.k, name)
