"""ModelSpec: the numbers and switches that tell the supported decoder families apart, as data.

Llama, SmolLM2 and Mistral share one decoder; Qwen2 adds biases to the q/k/v projections, Qwen3 adds a
per-head RMSNorm on q and k before RoPE. Gemma 3 differs in more places, each one a field here rather than a
class of its own: norms scale by ``1 + w`` (``norm_offset``), the gated MLP uses GeLU-tanh (``activation``),
embeddings are multiplied by ``sqrt(hidden)`` (``embed_scale``), q/k norms, the softmax scale comes from
``query_pre_attn_scalar`` (``attn_scale``), attention and MLP outputs are normalised too (four norms a layer,
``sandwich_norms``), and its layers alternate windowed and full attention (``layer_windows``) with a RoPE
base of their own for the windowed ones (``local_rope``). Phi-3 computes the Llama decoder, but its checkpoints
hold q|k|v and gate|up as one tensor each (``fused_checkpoint``) and Phi-4-mini rotates only part of each head
(``rotary_dim``); its long-context RoPE (``longrope``) and YaRN are ``rope`` data (``rope_scaling.py``).
Qwen3-MoE, Qwen2-MoE and Mixtral are Qwen3, Qwen2 and Mistral with sparse mixture-of-experts layers,
described by ``moe`` (``model/moe_spec.py``).

Everything is read here, from the HF config, in one place: the model code has no ``getattr`` chains, and a
config that asks for maths pagedkv does not do fails at once, with the field's name in the message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.model.rope import rope_parameters
from pagedkv.model.rope_scaling import check_rope

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pagedkv.model.moe_spec import MoESpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
SUPPORTED_MODEL_TYPES += ("qwen2_moe", "qwen3_moe", "mixtral")  # mixture-of-experts (model/moe_spec.py)
# families whose HF code rotates part of a head when the config's partial_rotary_factor says so (Llama's does not)
_PARTIAL_ROTARY_TYPES = ("phi3",)
# the config's activation name -> the gated MLP's activation (``GatedMLP``): silu (SwiGLU) or GeLU-tanh (GeGLU)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_TYPES = ("full_attention", "sliding_attention")
# fields that change the maths when set, which no supported family uses: refused by name, never ignored
_UNSUPPORTED_WHEN_SET = ("attn_logit_softcapping", "final_logit_softcapping")


class UnsupportedModelError(ValueError):
    """A model configuration asks for something pagedkv does not compute; the message names the field."""


@dataclass(slots=True, frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_positions: int  # the model's max_position_embeddings (longrope's factor is inferred from it)
    max_model_len: int  # longest context served exactly (a context-wide window and the engine's limit cap it):
    # the RoPE tables' rows
    rope: dict[str, Any]  # RoPE of the full-attention layers (every layer's, without local_rope)
    rotary_dim: int  # leading dimensions of each q/k head that RoPE rotates (head_dim but for a partial factor)
    activation: str = "silu"  # the gated MLP's activation: a value of ACTIVATIONS
    norm_offset: float = 0.0  # every RMSNorm (q/k norms too) scales by ``norm_offset + w``: 1.0 for Gemma
    embed_scale: float = 1.0  # token embeddings are multiplied by this: sqrt(hidden) for Gemma
    attn_scale: float | None = None  # the softmax scale (None: head_dim ** -0.5)
    sandwich_norms: bool = False  # also a norm on the attention output and one each side of the MLP (Gemma)
    layer_windows: tuple[int, ...] = ()  # per layer: 0 = full attention, w = keys (p - w, p] only (empty: all 0)
    local_rope: dict[str, Any] | None = None  # RoPE of the windowed layers, where it differs from ``rope``
    fused_checkpoint: bool = False  # the checkpoint holds q|k|v and gate|up as one tensor each (Phi-3)
    moe: MoESpec | None = None  # the sparse mixture-of-experts layers (model/moe_spec.py), if any

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def window(self, layer: int) -> int:
        """Layer ``layer``'s attention window (0: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def layer_rope(self, layer: int) -> dict[str, Any]:
        return self.local_rope if self.local_rope is not None and self.window(layer) else self.rope

    @classmethod
    def from_hf_config(cls, config: Any, max_model_len: int | None = None) -> ModelSpec:
        """The description of ``config``'s model; ``max_model_len``: the engine's limit on the context, if any
        (it caps ``max_model_len`` and decides which of longrope's factor sets serves, see rope_scaling.py)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported: pagedkv runs {SUPPORTED_MODEL_TYPES} models"
            )
        for name in _UNSUPPORTED_WHEN_SET:
            if getattr(config, name, None) is not None:
                raise UnsupportedModelError(
                    f"{name}={getattr(config, name)!r} is not supported: use a model without it"
                )
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {num_heads} must be a multiple of num_key_value_heads {num_kv_heads}"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        max_positions = int(config.max_position_embeddings)
        common = dict(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            max_positions=max_positions,
            activation=_activation(config),
            rotary_dim=_rotary_dim(config, model_type, head_dim),
        )
        if model_type == "gemma3_text":
            served = min(max_positions, max_model_len or max_positions)
            fields = _gemma3_fields(config, attention_bias, served)
            for key in ("rope", "local_rope"):
                fields[key] = _served_rope(fields[key], common["rotary_dim"], served)
            return cls(**common, **fields)
        from pagedkv.model.moe_spec import moe_spec  # it imports this module's error type

        qwen2_like = model_type in ("qwen2", "qwen2_moe")  # q/k/v biases (Qwen2-MoE's as ``qkv_bias`` says)
        qwen2_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(config.qkv_bias))
        served = min(max_positions, _context_window(config) or max_positions, max_model_len or max_positions)
        return cls(
            **common,
            qkv_bias=attention_bias or qwen2_bias,
            o_bias=attention_bias and not qwen2_like,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            max_model_len=served,
            rope=_served_rope(rope_parameters(config), common["rotary_dim"], served),
            fused_checkpoint=model_type == "phi3",
            moe=moe_spec(config),
        )


def _activation(config: Any) -> str:
    field = "hidden_activation" if getattr(config, "hidden_activation", None) else "hidden_act"
    name = getattr(config, field, None) or "silu"
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"{field}={name!r} is not supported: the gated MLP computes {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _rotary_dim(config: Any, model_type: str, head_dim: int) -> int:
    """How many leading dimensions of a head RoPE rotates: ``int(head_dim * partial_rotary_factor)``, as HF."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    if factor != 1.0 and model_type not in _PARTIAL_ROTARY_TYPES:
        raise UnsupportedModelError(
            f"partial_rotary_factor={factor!r} is not supported for {model_type!r}: pagedkv rotates part of a "
            f"head only for {_PARTIAL_ROTARY_TYPES}, as HF does"
        )
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UnsupportedModelError(
            f"partial_rotary_factor={factor!r} rotates {rotary_dim} of {head_dim} dimensions: it must be an even "
            "number from 2 to head_dim"
        )
    return rotary_dim


def _served_rope(rope: dict[str, Any], rotary_dim: int, served: int) -> dict[str, Any]:
    """``rope``, checked, with longrope's factor set decided for the served context: the long factors when it
    exceeds ``original_max_position_embeddings`` (vLLM's rule; rope_scaling.py says why)."""
    problem = check_rope(rope, rotary_dim)
    if problem is not None:
        raise UnsupportedModelError(f"{problem}: use a model without that RoPE scaling")
    if rope["rope_type"] != "longrope":
        return rope
    original = int(rope["original_max_position_embeddings"])
    if served > original:
        logger.warning(
            "longrope: the long factors rotate every position, for a max_model_len of %d (> %d, the original "
            "context); HF uses the short ones while a sequence is within %d tokens: pass max_model_len=%d for them",
            served,
            original,
            original,
            original,
        )
    return {**rope, "long_context": served > original}


def _gemma3_fields(config: Any, attention_bias: bool, served: int) -> dict[str, Any]:
    """Gemma 3 (text): every difference from the Llama decoder, read and checked field by field."""
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention=True is not supported: pagedkv decodes causally")
    layer_types = list(getattr(config, "layer_types", None) or [])
    if len(layer_types) != config.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
        raise UnsupportedModelError(
            f"layer_types={layer_types!r} is not supported: one of {LAYER_TYPES} per layer "
            f"({config.num_hidden_layers} layers)"
        )
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
        raise UnsupportedModelError(f"sliding_window={window!r}: windowed layers need a window of >= 1 token")
    params = dict(getattr(config, "rope_parameters", None) or {})
    if set(params) != {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(
            f"rope_parameters={params!r} is not supported: Gemma 3 needs one entry per layer type {LAYER_TYPES}"
        )
    return dict(
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=True,
        max_model_len=served,  # windowed layers attend through their window: only the engine's limit caps it
        rope=_rope_entry(params["full_attention"]),
        local_rope=_rope_entry(params["sliding_attention"]),
        norm_offset=1.0,
        embed_scale=float(config.hidden_size) ** 0.5,
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
        sandwich_norms=True,
        layer_windows=tuple(window if kind == "sliding_attention" else 0 for kind in layer_types),
    )


def _rope_entry(params: dict[str, Any]) -> dict[str, Any]:
    """One layer type's RoPE parameters in the form ``rope.inverse_frequencies`` reads."""
    entry = dict(params)
    entry["rope_type"] = entry.get("rope_type", entry.get("type")) or "default"
    entry.setdefault("rope_theta", 10000.0)
    return entry


def _context_window(config: Any) -> int | None:
    """The attention window of every layer, if the config turns one on (Mistral v0.1; Qwen with
    use_sliding_window).

    Within the window, windowed and full attention agree, so these families stay exact by capping the
    context length at the window; Gemma 3's per-layer windows are computed for real (``layer_windows``).
    """
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)
