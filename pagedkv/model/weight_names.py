"""Where each tensor of a Hugging Face checkpoint goes in :class:`~pagedkv.model.llama.LlamaForCausalLM`.

The model fuses q/k/v and gate/up into one linear layer each and, with tensor parallelism, keeps only this
rank's shard; a checkpoint names the unfused, whole tensors. :func:`weight_targets` maps every HF parameter
name to a loader that shards the tensor and copies it into its rows of the fused parameter.

Phi-3 checkpoints hold the fused tensors already (``qkv_proj``, ``gate_up_proj``): their rows are split into
the parts at load and each part goes through its own loader, so a rank still takes its heads' rows of each
part. The model computes the same fused GEMM either way: splitting costs a row copy at load, nothing a step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pagedkv.model.gguf_file import GGUFTensor
from pagedkv.model.moe import SparseMoeBlock
from pagedkv.parallel.group import TensorParallel

if TYPE_CHECKING:
    from pagedkv.model.llama import LlamaForCausalLM

WeightLoader = Callable[[Tensor], None]


def weight_targets(model: LlamaForCausalLM) -> dict[str, WeightLoader]:
    """HF parameter name -> function that copies that tensor into its (possibly fused) place."""
    spec, tp = model.spec, model.tp
    vocab = _sharded(lambda t: _vocab_shard(tp, t, spec.vocab_size))
    targets: dict[str, WeightLoader] = {
        "model.embed_tokens.weight": vocab(partial(_load_embedding, model)),
        "model.norm.weight": _copier(model.norm.weight, offset=spec.norm_offset),
    }
    if not spec.tie_word_embeddings:
        targets["lm_head.weight"] = vocab(partial(model.lm_head.load_part, "weight", 0))
    columns, rows = _sharded(lambda t: tp.shard(t, 0)), _sharded(lambda t: tp.shard(t, 1))
    once = _sharded(lambda t: t if tp.is_driver else torch.zeros_like(t))  # a row-parallel bias: added once
    if tp.exact:  # o_proj and down_proj split by output rows, like the column-parallel layers
        rows = once = columns
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        q_size, kv_size = attn.num_heads * spec.head_dim, attn.num_kv_heads * spec.head_dim
        # (name, layer, first row in the fused local weight, how weight and bias are sharded)
        fused = [
            ("self_attn.q_proj", attn.qkv_proj, 0, columns, columns, spec.qkv_bias),
            ("self_attn.k_proj", attn.qkv_proj, q_size, columns, columns, spec.qkv_bias),
            ("self_attn.v_proj", attn.qkv_proj, q_size + kv_size, columns, columns, spec.qkv_bias),
            ("self_attn.o_proj", attn.o_proj, 0, rows, once, spec.o_bias),
        ]
        if isinstance(mlp, SparseMoeBlock):  # a mixture-of-experts layer names its own (never sharded) weights
            targets.update(mlp.weight_targets(f"{prefix}{spec.moe.checkpoint_block}."))
        else:
            fused += [
                ("mlp.gate_proj", mlp.gate_up_proj, 0, columns, columns, spec.mlp_bias),
                ("mlp.up_proj", mlp.gate_up_proj, mlp.intermediate, columns, columns, spec.mlp_bias),
                ("mlp.down_proj", mlp.down_proj, 0, rows, once, spec.mlp_bias),
            ]
        for name, linear, offset, weight_shard, bias_shard, has_bias in fused:
            targets[f"{prefix}{name}.weight"] = weight_shard(partial(linear.load_part, "weight", offset))
            if has_bias:
                targets[f"{prefix}{name}.bias"] = bias_shard(partial(linear.load_part, "bias", offset))
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if spec.sandwich_norms else []
        for norm in norms:
            targets[f"{prefix}{norm}.weight"] = _copier(getattr(layer, norm).weight, offset=spec.norm_offset)
        if attn.qk_norm_weight is not None:  # each head's row gets the same per-channel weight
            q_rows, k_rows = attn.qk_norm_weight.split([attn.num_heads, attn.num_kv_heads])
            targets[prefix + "self_attn.q_norm.weight"] = _copier(q_rows, broadcast=True, offset=spec.norm_offset)
            targets[prefix + "self_attn.k_norm.weight"] = _copier(k_rows, broadcast=True, offset=spec.norm_offset)
        if spec.fused_checkpoint:
            q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            qkv = [("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv_rows), ("self_attn.v_proj", kv_rows)]
            _fuse(targets, prefix, "self_attn.qkv_proj", qkv)
            gate_up = [("mlp.gate_proj", spec.intermediate_size), ("mlp.up_proj", spec.intermediate_size)]
            _fuse(targets, prefix, "mlp.gate_up_proj", gate_up)
    return targets


def _fuse(targets: dict[str, WeightLoader], prefix: str, fused: str, parts: list[tuple[str, int]]) -> None:
    """Replace the parts' targets by one for the checkpoint's fused tensor ``fused`` (weight, and bias where the
    parts have one), whose rows are the parts' whole rows in order (``parts``: name and number of rows)."""
    rows = [count for _, count in parts]
    for kind in ("weight", "bias"):
        loaders = [targets.pop(f"{prefix}{name}.{kind}", None) for name, _ in parts]
        if loaders[0] is None:
            continue

        def load(tensor: Tensor | GGUFTensor, loaders: list[WeightLoader] = loaders, name: str = fused) -> None:
            if tensor.shape[0] != sum(rows):
                raise ValueError(
                    f"checkpoint tensor {prefix}{name} has {tensor.shape[0]} rows, the config's parts {sum(rows)}: "
                    "the config does not match the weights"
                )
            start = 0
            for loader, count in zip(loaders, rows, strict=True):
                loader(tensor.narrow(0, start, count))
                start += count

        targets[f"{prefix}{fused}.{kind}"] = load


def _load_embedding(model: LlamaForCausalLM, tensor: Tensor | GGUFTensor) -> None:
    if isinstance(tensor, GGUFTensor):
        model.use_file_embedding(tensor)
    else:
        _copier(model.embed_tokens)(tensor)


def _vocab_shard(tp: TensorParallel, tensor: Tensor | GGUFTensor, vocab_size: int) -> Tensor | GGUFTensor:
    """This rank's rows of a vocabulary-sized matrix, a GGUF file's blocks included (padded with zero blocks)."""
    if not isinstance(tensor, GGUFTensor):
        return tp.shard_vocab(tensor, vocab_size)
    rows = tp.vocab_rows(vocab_size)
    start = min(tp.rank * rows, tensor.shape[0])
    part = tensor.narrow(0, start, min(rows, tensor.shape[0] - start))
    return part if part.shape[0] == rows else part.pad_rows(rows)


def _copier(param: Tensor, broadcast: bool = False, offset: float = 0.0) -> WeightLoader:
    """Copies a checkpoint tensor into ``param``; ``offset`` is added on the way (a Gemma norm's ``1 + w``, held
    as the weight the norm kernels multiply by: the same fp32 sum HF computes at every call)."""

    def copy(tensor: Tensor) -> None:
        shape_ok = tensor.shape == param.shape[-tensor.dim() :] if broadcast else tensor.shape == param.shape
        if not shape_ok:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit a parameter of shape "
                f"{tuple(param.shape)}: the config does not match the weights"
            )
        param.data.copy_(tensor)
        if offset:
            param.data.add_(offset)

    return copy


def _sharded(shard: Callable[[Tensor], Tensor]) -> Callable[[WeightLoader], WeightLoader]:
    """Wrap a loader so it receives this rank's shard of the checkpoint tensor."""
    return lambda load: lambda tensor: load(shard(tensor))
