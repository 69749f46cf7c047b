"""All decoder layers in one compiled call (``csrc/decoder_stack.cpp``), where the model's configuration allows.

A one-row step runs ~10 small ops per layer; reaching each from Python costs about as much as the op itself
(measured on the default model, gguf, 2 threads, one decode: the layers took 12.5 ms through the modules and
8.4 ms in the GEMMs and attention alone). The stack runs the same ops, in the same order, on the same
tensors from C++, so every step gets the modules' bits, and the modules stay the reference and the fallback.

It serves the configuration the engine runs by default on a machine that builds the kernels: every linear
layer panel-packed and without bias, no q/k norm, the compiled attention kernel, one process. Anything else
-- torch's ops, the gather backend, tensor parallelism, Qwen2's biases, Qwen3's q/k norm -- runs the modules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import KernelAttention
from pagedkv.model.panel import FORMATS


class DecoderStack:
    """The compiled stack of one model's layers, and the KV pools it was last bound to."""

    def __init__(self, model: nn.Module) -> None:
        norms: list[Tensor] = []
        packed: list[Tensor] = []
        dims: list[int] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                packed.append(linear.panel.packed)
                dims += [linear.panel.n, linear.panel.k, FORMATS[linear.panel.format]]
        first = model.layers[0].self_attn
        self._stack = torch.classes.pagedkv.DecoderStack(
            norms, packed, dims, first.num_heads, first.num_kv_heads, first.head_dim, first.eps, first.scale
        )
        self._pools: Sequence[tuple[Tensor, Tensor]] | None = None

    def __call__(
        self, h: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_caches: Sequence[tuple[Tensor, Tensor]]
    ) -> Tensor:
        """What ``for layer in model.layers: h = layer(h, cos, sin, meta, kv_cache)`` computes, to the bit."""
        if not _same_pools(kv_caches, self._pools):  # the runner keeps its pools for life: bound once
            self._stack.bind_pools([k for k, _ in kv_caches], [v for _, v in kv_caches])
            self._pools = list(kv_caches)
        return self._stack.forward(
            h.contiguous(), cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc
        )


def _same_pools(pools: Sequence[tuple[Tensor, Tensor]], bound: Sequence[tuple[Tensor, Tensor]] | None) -> bool:
    """Whether ``pools`` are the very (k, v) pairs last bound (identity, not contents: ~2 us for 30 layers)."""
    return bound is not None and len(pools) == len(bound) and all(a is b for a, b in zip(pools, bound, strict=True))


def stack_for(model: nn.Module) -> DecoderStack | None:
    """A :class:`DecoderStack` for ``model`` if every layer fits the compiled one (see the module docstring)."""
    if model.tp.world_size != 1 or not isinstance(model.attention, KernelAttention):
        return None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m.panel is None or m.bias is not None for m in linears) or attn.qk_norm_weight is not None:
            return None
        if not (attn.compiled and mlp.compiled and layer.input_layernorm.compiled):
            return None
    return DecoderStack(model)
