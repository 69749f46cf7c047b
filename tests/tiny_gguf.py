"""Tiny random GGUF models written in the tests, in any tensor type: what pagedkv reads natively and what HF
transformers, loading the same file, is compared with.

The ``gguf`` package writes the file and quantises the legacy types (Q4_0 ... Q8_0, F16, BF16) itself, as
llama.cpp's converter does, including llama's q/k row interleaving. It cannot quantise the K-quants: their
tensors are random blocks instead (random bytes are valid K-quant blocks once their fp16 scales are finite
and small), so those models are random in their codes rather than quantised from a random fp32 model; the
reference reads the same blocks either way.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen2Config

LEGACY = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# K-quant block layouts: bytes per 256-weight block, and where its fp16 super-block scales (d, dmin) sit
K_SCALES = {
    T.Q2_K: (84, (80, 82)),
    T.Q3_K: (110, (108,)),
    T.Q4_K: (144, (0, 2)),
    T.Q5_K: (176, (0, 2)),
    T.Q6_K: (210, (208,)),
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # phi3: q|k|v in one tensor
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate|up in one tensor, under llama.cpp's name for up
}
CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "phi3": Phi3Config}
EOS = 3


def save_tiny_gguf(
    path: Path,
    ggml_type: T,
    architecture: str = "llama",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    embedding_type: T | None = None,
    part_types: dict[str, T] | None = None,
    split_max_tensors: int = 0,
    **config: object,
) -> Path:
    """Write a random ``architecture`` model (llama, qwen2 or phi3) whose 2-D weights are ``ggml_type`` to ``path``.

    ``embedding_type``: the token embedding's type (default the same); ``part_types``: other types by GGUF part
    name (``{"attn_v": Q6_K, "ffn_down": Q6_K}`` mixes types in one layer as Q4_K_M files do). Norms and biases
    stay F32, as llama.cpp keeps them. ``split_max_tensors``: write a split set (``path``'s stem + ``-00001-of-N``)
    of files holding at most that many tensors each, as llama.cpp's gguf-split does; returns the first file."""
    part_types = part_types or {}
    k_quant = any(t in K_SCALES for t in (ggml_type, embedding_type, *part_types.values()))
    settings = {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512 if k_quant else 384,  # a K-quant row is whole 256-weight blocks
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": EOS,
        "bos_token_id": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    if architecture == "phi3":
        settings["pad_token_id"] = 0  # HF's Phi-3 default, 32000, is outside a tiny vocabulary
    settings.update(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIG_CLASSES[architecture](**settings), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    writer = gguf.GGUFWriter(str(path), architecture, split_max_tensors=split_max_tensors)
    _write_metadata(writer, architecture, settings)
    if architecture == "phi3":
        _write_phi3_keys(writer, model.config)
    if model.config.rope_parameters.get("rope_type") == "llama3":
        _write_llama3_freqs(writer, model.config)
    rng = np.random.default_rng(seed)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        gguf_name = _gguf_name(name)
        data = tensor.numpy()
        if architecture == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = settings["num_attention_heads"] if "attn_q" in gguf_name else settings["num_key_value_heads"]
            data = _interleave(data, heads)
        wanted = part_types.get(gguf_name.split(".")[-2], ggml_type)
        if name == "model.embed_tokens.weight":
            wanted = embedding_type or ggml_type
        _add(writer, gguf_name, data, wanted if data.ndim == 2 else T.F32, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0] if split_max_tensors else path


def _write_metadata(writer: gguf.GGUFWriter, architecture: str, s: dict) -> None:
    writer.add_block_count(s["num_hidden_layers"])
    writer.add_context_length(s["max_position_embeddings"])
    writer.add_embedding_length(s["hidden_size"])
    writer.add_feed_forward_length(s["intermediate_size"])
    writer.add_head_count(s["num_attention_heads"])
    writer.add_head_count_kv(s["num_key_value_heads"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(s["rms_norm_eps"])
    writer.add_vocab_size(s["vocab_size"])
    # a byte-level BPE vocabulary ("gpt2", as SmolLM2's and Qwen's): the 256 byte symbols, then letter pairs
    symbols = list(_byte_symbols())
    tokens = ["<unk>", "<s>", "<pad>", "</s>"] + symbols
    pairs = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]
    pairs = pairs[: s["vocab_size"] - len(tokens)]
    tokens += pairs
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 3] + [1] * (len(tokens) - 4))
    writer.add_token_merges([f"{p[0]} {p[1]}" for p in pairs])
    writer.add_bos_token_id(s["bos_token_id"])
    writer.add_eos_token_id(s["eos_token_id"])
    writer.add_chat_template(
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )


def _write_phi3_keys(writer: gguf.GGUFWriter, config: Phi3Config) -> None:
    """What llama.cpp's converter writes for a Phi-3 beyond llama's keys: the padding token, the rotated
    dimensions, the original context, the window (0: none) and, for longrope, the attention factor and the two
    factor sets as tensors."""
    writer.add_pad_token_id(config.pad_token_id)
    head_dim = config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_sliding_window(config.sliding_window or 0)
    if rope["rope_type"] != "longrope":
        return
    scale = config.max_position_embeddings / config.original_max_position_embeddings
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings))
    )
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _write_llama3_freqs(writer: gguf.GGUFWriter, config: LlamaConfig) -> None:
    """Llama 3's RoPE scaling as llama.cpp's converter stores it: no keys, one frequency divisor a rotated pair
    (``rope_freqs.weight``), computed in fp32 from the scaling parameters."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    divisors = []
    for freq in 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)):
        wavelength = 2 * math.pi / freq
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(float(1 / ((1 - smooth) / factor + smooth)))
    writer.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))


def _byte_symbols():
    """GPT-2's printable stand-ins for the 256 byte values (each byte-level BPE vocabulary starts with them)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = 0
    for b in range(256):
        if b in printable:
            yield chr(b)
        else:
            yield chr(256 + extra)
            extra += 1


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for llama's q and k: each head's two halves interleaved row by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, ggml_type: T, rng: np.random.Generator) -> None:
    if ggml_type in K_SCALES:
        writer.add_tensor(name, random_k_blocks(ggml_type, data.shape, rng), raw_dtype=ggml_type)
    elif ggml_type == T.F32:
        writer.add_tensor(name, data.astype(np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), ggml_type), raw_dtype=ggml_type)


def random_k_blocks(ggml_type: T, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 4e-4) -> np.ndarray:
    """Random blocks of a K-quant type for a weight ``shape`` (``[n, k]``), ``uint8 [n, k / 256 * block bytes]``,
    its super-block scales set to small positive fp16 values so the weights stay O(0.1)."""
    block_bytes, scale_offsets = K_SCALES[ggml_type]
    n, k = shape
    blocks = rng.integers(0, 256, size=(n, k // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        values = (rng.random((n, k // 256)) * scale + scale / 4).astype(np.float16)
        blocks[..., offset : offset + 2] = values.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)
