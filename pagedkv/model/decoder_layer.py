"""The decoder layer that :class:`pagedkv.model.llama.LlamaForCausalLM` stacks: attention over the paged pool,
then the gated MLP (or a sparse MoE block), each on the residual stream; what differs by family comes from the
:class:`ModelSpec`. The model's docstring tells a forward pass and the tensor-parallel shard a layer holds."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import AttentionBackend
from pagedkv.model.layers import GatedMLP, Linear, RMSNorm, empty_parameter
from pagedkv.model.moe import SparseMoeBlock
from pagedkv.model.rope import rotate_heads
from pagedkv.model.spec import ModelSpec
from pagedkv.parallel.group import TensorParallel


class LlamaAttention(nn.Module):
    """q/k/v in one GEMM, optional per-head q/k norms, RoPE, then paged attention over the layer's window
    (``window`` 0: the whole context; else a query at position p sees keys (p - window, p])."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, attention: AttentionBackend, tp: TensorParallel, window: int = 0
    ) -> None:
        super().__init__()
        self.num_heads = tp.split(spec.num_heads, "query heads")
        self.num_kv_heads = tp.split(spec.num_kv_heads, "KV heads")
        self.head_dim = spec.head_dim
        self.rotary_dim = spec.rotary_dim
        self.scale = spec.softmax_scale
        self.window = window
        self.attention = attention
        self.eps = spec.rms_norm_eps
        self.tp = tp
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(spec.hidden_size, qkv_size, spec.qkv_bias, dtype)
        o_shape = tp.row_parallel_shape(self.num_heads * self.head_dim, spec.hidden_size)  # (in, out)
        self.o_proj = Linear(*o_shape, spec.o_bias, dtype)
        # Qwen3's q_norm and k_norm, one row per head ([Hq + Hkv, D]) so both run as one normalisation.
        rows = self.num_heads + self.num_kv_heads
        self.qk_norm_weight = empty_parameter(rows, spec.head_dim, dtype=torch.float32) if spec.qk_norm else None
        self.compiled = False  # RoPE in place, in C++ (set by the model with its compiled kernels)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_cache: tuple[Tensor, Tensor]
    ) -> Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)
        split = self.num_heads + self.num_kv_heads
        qk = qkv[:, :split]
        if self.qk_norm_weight is not None:
            qk = nn.functional.rms_norm(qk, (self.head_dim,), eps=self.eps) * self.qk_norm_weight
        qk = rotate_heads(qk, cos, sin, self.rotary_dim, self.compiled)
        out = self.attention.forward(
            qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, split:], *kv_cache, meta, self.scale, self.window
        )
        return self.tp.row_parallel(self.o_proj, out.view(tokens, -1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream. With ``spec.sandwich_norms`` (Gemma) the
    names mean what HF's Gemma layers mean: ``post_attention_layernorm`` normalises the attention output before
    the add, ``pre_feedforward_layernorm`` the MLP's input and ``post_feedforward_layernorm`` its output; without
    them ``post_attention_layernorm`` is the MLP's input norm, as in HF's Llama. ``rope``: which of the model's
    RoPE tables the layer rotates with (0: the full-attention layers', 1: the windowed layers' own)."""

    def __init__(
        self, spec: ModelSpec, index: int, dtype: torch.dtype, attention: AttentionBackend, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.rope = int(spec.layer_rope(index) is not spec.rope)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, dtype, attention, tp, spec.window(index))
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp: GatedMLP | SparseMoeBlock
        if spec.moe is not None and spec.moe.sparse_layers[index]:
            self.mlp = SparseMoeBlock(spec.hidden_size, spec.moe, dtype, tp)
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, dtype, tp, spec.activation)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_cache: tuple[Tensor, Tensor]
    ) -> Tensor:
        attended = self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache)
        if not self.sandwich:
            h += self.mlp(self.post_attention_layernorm(attended, residual=h))  # h += attended, then the norm
            return h
        # h += post_attention_norm(attended), then the MLP's input norm of the sum
        mlp_in = self.pre_feedforward_layernorm(self.post_attention_layernorm(attended), residual=h)
        h += self.post_feedforward_layernorm(self.mlp(mlp_in))
        return h
