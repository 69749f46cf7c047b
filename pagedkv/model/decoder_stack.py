"""All decoder layers in one compiled call (``csrc/decoder_stack.cpp``), where the model's configuration allows.

A one-row step runs ~10 small ops per layer; reaching each from Python costs about as much as the op itself
(measured on the default model, gguf, 2 threads, one decode: the layers took 12.5 ms through the modules and
8.4 ms in the GEMMs and attention alone). The stack runs the same ops, in the same order, on the same
tensors from C++, so every step gets the modules' bits, and the modules stay the reference and the fallback.

It serves every model the engine runs by default on a machine that builds the kernels: each linear layer
panel-packed, in one part or in parts of different formats (a GGUF file's fused q|k|v or gate|up, mixed in
every Q4_K_M file), with or without biases (Qwen2), with or without a q/k norm (Qwen3, Gemma), the compiled
attention kernel and norms, one process; and Gemma 3's layers: four norms, GeLU-tanh, each layer's window and
RoPE table. These cost the stack nothing in exactness: it calls the ops the modules call (``panel_linear_into``
per part, ``add_`` for a bias, torch's ``rms_norm`` and ``mul`` for the q/k norm, torch's ``gelu`` and ``mul``
for GeGLU). Measured on Gemma 3 270M Q4_K_M (2 threads, one decode): the stack cut a step's CPU time by
about a third (docs/models-gemma3-speed.md). What runs the modules is what it cannot call from C++ as they do:
torch's GEMM (weights left unpacked), torch's attention or norms (the gather backend, ``kernels=False``),
tensor parallelism (its collectives), a mixture-of-experts MLP. Phi-4-mini's partial rotary runs in the stack:
it rotates the same strided view of each head's leading ``rotary_dim`` dimensions with the same ``rope_`` as
``rotate_heads``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pagedkv import kernels
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import KernelAttention
from pagedkv.model.panel import FORMATS

logger = logging.getLogger(__name__)


class DecoderStack:
    """The compiled stack of one model's layers, and the KV pools it was last bound to."""

    def __init__(self, model: nn.Module) -> None:
        first = model.layers[0].self_attn
        self._stack = torch.classes.pagedkv.DecoderStack(
            first.num_heads, first.num_kv_heads, first.head_dim, model.spec.rotary_dim, first.eps, first.scale
        )
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            parts = [part for linear in linears for part in linear.panels]
            mlp_norms = []
            if layer.sandwich:  # Gemma's MLP input and output norms
                mlp_norms = [layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight]
            self._stack.add_layer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                attn.qk_norm_weight,
                [part.packed for part in parts],
                [dim for part in parts for dim in (part.n, part.k, FORMATS[part.format])],
                [len(linear.panels) for linear in linears],
                [linear.bias for linear in linears],
                mlp_norms,
                attn.window,
                layer.rope,
                mlp.activation != "silu",  # stack_for lets only SiLU and GeLU-tanh through
            )
        self._pools: Sequence[tuple[Tensor, Tensor]] | None = None

    def __call__(
        self,
        h: Tensor,
        tables: Sequence[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        kv_caches: Sequence[tuple[Tensor, Tensor]],
        window_meta: AttentionMetadata | None = None,
    ) -> Tensor:
        """What ``LlamaForCausalLM.hidden_states`` computes through the layer modules, to the bit; ``tables``: each
        RoPE's ``(cos, sin_signed)`` for the step's positions; ``window_meta``: the windowed layers' own block
        tables and slots, where the KV manager keeps them apart (None: every layer reads ``meta``'s)."""
        if not _same_pools(kv_caches, self._pools):  # the runner keeps its pools for life: bound once
            self._stack.bind_pools([k for k, _ in kv_caches], [v for _, v in kv_caches])
            self._pools = list(kv_caches)
        return self._stack.forward(
            h.contiguous(),
            [cos for cos, _ in tables],
            [sin for _, sin in tables],
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            None if window_meta is None else window_meta.slot_mapping,
            None if window_meta is None else window_meta.block_tables,
        )


def _same_pools(pools: Sequence[tuple[Tensor, Tensor]], bound: Sequence[tuple[Tensor, Tensor]] | None) -> bool:
    """Whether ``pools`` are the very (k, v) pairs last bound (identity, not contents: ~2 us for 30 layers)."""
    return bound is not None and len(pools) == len(bound) and all(a is b for a, b in zip(pools, bound, strict=True))


def stack_for(model: nn.Module) -> DecoderStack | None:
    """A :class:`DecoderStack` for ``model`` if every layer fits the compiled one (see the module docstring)."""
    if model.tp.world_size != 1 or not isinstance(model.attention, KernelAttention):
        return None
    spec = model.spec
    if spec.activation not in ("silu", "gelu_tanh"):
        logger.info(
            "%s layers (activation %s) run as modules: the compiled decoder stack computes SiLU or GeLU-tanh layers",
            spec.model_type,
            spec.activation,
        )
        return None
    if spec.moe is not None:
        logger.info(
            "%s layers run as modules: the compiled decoder stack has no mixture-of-experts block", spec.model_type
        )
        return None
    if not kernels.portable.available():  # the class's library: the modules' ops load it at their first call
        return None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(m.panels for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return None
        if not (attn.compiled and mlp.compiled and layer.input_layernorm.compiled):
            return None
    return DecoderStack(model)
