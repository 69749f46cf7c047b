"""MoESpec: what a mixture-of-experts family adds to the decoder's description, read from the HF config.

Mixtral is the Mistral decoder with every layer sparse, the same block (renormalised router weights always).

Qwen3-MoE and Qwen2-MoE replace some layers' MLP with a sparse block: a router (one linear layer, softmax over
``num_experts``) picks each token's ``num_experts_per_tok`` experts, each expert a SwiGLU MLP of width
``moe_intermediate_size``, and sums their outputs weighted by the router's probabilities -- renormalised over
the chosen experts when ``norm_topk_prob`` is set. Qwen2-MoE adds a shared expert every token runs, scaled by
a sigmoid gate. Which layers are sparse follows HF exactly: not in ``mlp_only_layers``, and
``(layer + 1) % decoder_sparse_step == 0``; the other layers keep a dense MLP of width ``intermediate_size``.

Router training terms (``output_router_logits``, ``router_aux_loss_coef``) do not touch inference and are
ignored; anything else that would change the maths is refused with its field's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.model.spec import UnsupportedModelError

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
_QWEN_EXPERT = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_EXPERT = ("w1", "w3", "w2")  # gate, up, down in Mixtral's checkpoints


@dataclass(slots=True, frozen=True)
class MoESpec:
    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the chosen experts' probabilities to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: the sparse block (True) or the dense MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    checkpoint_block: str = "mlp"  # the checkpoint's name of a layer's sparse block: mlp.gate.weight, ...
    expert_parts: tuple[str, str, str] = _QWEN_EXPERT  # the checkpoint's names of an expert's gate, up, down


def moe_spec(config: Any) -> MoESpec | None:
    """The MoE description of a ``qwen3_moe`` / ``qwen2_moe`` / ``mixtral`` config (None for a dense family, or
    when ``num_experts`` is 0: every layer dense, as HF builds it)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type == "mixtral":
        return _mixtral(config)
    num_experts = _positive_int(config, "num_experts", allow_zero=True)
    if num_experts == 0:
        return None
    top_k = _positive_int(config, "num_experts_per_tok")
    _check_top_k(top_k, num_experts)
    shared = 0  # a width of 0 adds HF's sigmoid(gate) * 0: exactly nothing
    if model_type == "qwen2_moe":
        shared = _positive_int(config, "shared_expert_intermediate_size", allow_zero=True)
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=_positive_int(config, "moe_intermediate_size"),
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        sparse_layers=_sparse_layers(config),
        shared_expert_intermediate_size=shared,
    )


def _mixtral(config: Any) -> MoESpec:
    """Mixtral: every layer sparse, experts as wide as ``intermediate_size``, the chosen experts' probabilities
    always renormalised (HF's router divides by their sum); ``router_jitter_noise`` is applied in training only."""
    num_experts = _positive_int(config, "num_local_experts")
    top_k = _positive_int(config, "num_experts_per_tok")
    _check_top_k(top_k, num_experts)
    return MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=_positive_int(config, "intermediate_size"),
        norm_topk_prob=True,
        sparse_layers=(True,) * int(config.num_hidden_layers),
        checkpoint_block="block_sparse_moe",
        expert_parts=_MIXTRAL_EXPERT,
    )


def _check_top_k(top_k: int, num_experts: int) -> None:
    if top_k > num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} exceeds the {num_experts} experts: a token cannot pick more experts "
            "than there are"
        )


def _sparse_layers(config: Any) -> tuple[bool, ...]:
    layers = int(config.num_hidden_layers)
    step = _positive_int(config, "decoder_sparse_step")
    dense = getattr(config, "mlp_only_layers", None) or []
    if not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise UnsupportedModelError(
            f"mlp_only_layers={dense!r} is not supported: layer indices in [0, {layers}) expected"
        )
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def _positive_int(config: Any, name: str, allow_zero: bool = False) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        raise UnsupportedModelError(
            f"{name}={value!r} is not supported: a {'non-negative' if allow_zero else 'positive'} integer expected"
        )
    return value
