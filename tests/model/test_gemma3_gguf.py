"""The ``gemma3`` GGUF architecture: a tiny random Gemma 3 written as llama.cpp's converter writes it (its own
names for the four norms a layer, every norm weight stored as ``1 + w``), read by pagedkv, against HF
transformers loading the same file (config and weights alike: transformers turns the file's metadata into the
config, so the windows, RoPE bases and softmax scale are the ones it infers for a GGUF file).

Model level only: transformers' GGUF tokenizer converter for ``gemma3`` wants a SentencePiece vocabulary,
which a tiny file does not carry; the real Gemma 3 270M file is not in the test dependencies yet.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from pagedkv import kernels
from pagedkv.model import gguf_weights
from pagedkv.model.gguf_file import GGUFFile
from pagedkv.model.llama import LlamaForCausalLM

TOL = 1e-4
WINDOW = 8
SETTINGS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,  # transformers infers sliding_window_pattern 6 for a GGUF file: 5 windowed, 1 full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
)
_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_PARTS[rest.rsplit('.', 1)[0]]}.weight"


def save_tiny_gemma3_gguf(path: Path, ggml_type: T) -> Path:
    """A random Gemma 3 (tied head, as every Gemma 3) whose 2-D weights are ``ggml_type``, norms F32 as 1 + w."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(**SETTINGS, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    s = SETTINGS
    writer.add_block_count(s["num_hidden_layers"])
    writer.add_context_length(s["max_position_embeddings"])
    writer.add_embedding_length(s["hidden_size"])
    writer.add_feed_forward_length(s["intermediate_size"])
    writer.add_head_count(s["num_attention_heads"])
    writer.add_head_count_kv(s["num_key_value_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_layer_norm_rms_eps(s["rms_norm_eps"])
    writer.add_sliding_window(WINDOW)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_vocab_size(s["vocab_size"])
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        data = (0.3 * torch.randn_like(tensor) if "norm" in name else 0.15 * torch.randn_like(tensor)).numpy()
        if name.endswith("norm.weight"):
            writer.add_tensor(_gguf_name(name), (data + 1).astype(np.float32))
        elif ggml_type == T.F32:
            writer.add_tensor(_gguf_name(name), data.astype(np.float32))
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(data, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("native", [False, True], ids=["dequantized", "native"])
@pytest.mark.parametrize("ggml_type", [T.F32, T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_gemma3_file_matches_hf_loading_it(tmp_path, ggml_type, native, paged_harness):
    if native and not kernels.gemm.available():
        pytest.skip("the panel GEMM cannot be built here: no native GGUF layers")
    path = save_tiny_gemma3_gguf(tmp_path / "gemma3.gguf", ggml_type)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert hf.config.model_type == "gemma3_text" and "sliding_attention" in hf.config.layer_types
    file = GGUFFile(path)
    gguf_weights.check_architecture(file)
    ours = LlamaForCausalLM(hf.config, weight_format="gguf" if native else "float32")
    tensors = gguf_weights.hf_tensors(file, ours.spec.num_heads, ours.spec.num_kv_heads)
    if native:
        ours.load_weights(gguf_weights.NativeTensors(tensors), after_layer=ours.use_kernels)
        ours.use_kernels()
    else:
        ours.load_weights(gguf_weights.DequantizedTensors(tensors))
    assert ours.spec.layer_windows == (WINDOW,) * 5 + (0,)
    prompt = torch.randint(0, SETTINGS["vocab_size"], (3 * WINDOW + 5,), generator=torch.Generator().manual_seed(1))
    harness = paged_harness(ours, block_size=4)
    chunks = [harness.step([("a", part)])[0] for part in (prompt[:10].tolist(), prompt[10:].tolist())]
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0]
    torch.testing.assert_close(torch.cat(chunks), reference, atol=TOL, rtol=0)
