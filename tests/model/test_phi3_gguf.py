"""The ``phi3`` GGUF architecture: tiny random Phi-3 files written as llama.cpp's converter writes them (fused
``attn_qkv`` and ``ffn_up``, the rotated dimensions, original context, window and longrope's attention factor
as keys, the two factor sets as ``rope_factors_*`` tensors), run by the whole engine on the file's own codes.

transformers' GGUF conversion drops that RoPE (it loads a Phi-3.5 or Phi-4-mini file with plain RoPE on whole
heads), so the reference for a longrope file is HF's ``Phi3ForCausalLM`` built from the config the file was
written from, holding the weights HF de-quantised from the file. A file with plain RoPE (Phi-3-mini-4k's
shape) is compared with HF loading the file alone.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoModelForCausalLM, Phi3Config

from pagedkv import LLM, SamplingParams
from tests.hf_reference import check_against_hf, random_prompt
from tests.tiny_gguf import save_tiny_gguf

VOCAB = 512
ORIGINAL = 48
SETTINGS = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4 * ORIGINAL,
    original_max_position_embeddings=ORIGINAL,
    rope_theta=500.0,
    pad_token_id=0,
)


def _longrope(partial: float) -> dict:
    pairs = int(32 * partial) // 2
    factors = {"short_factor": [1 + 0.05 * i for i in range(pairs)], "long_factor": [1 + 0.9 * i for i in range(pairs)]}
    return dict(partial_rotary_factor=partial, rope_scaling={"rope_type": "longrope", **factors})


VARIANTS = {
    "phi4-mini": _longrope(0.75),  # longrope on 3/4 of each head
    "phi3.5": _longrope(1.0),
    "phi3-4k": dict(sliding_window=40),  # plain RoPE; the window caps the context
}


@pytest.mark.parametrize(
    ("variant", "ggml_type"),
    [("phi4-mini", T.Q8_0), ("phi3.5", T.F32), ("phi3-4k", T.Q4_0)],
    ids=lambda v: getattr(v, "name", v),
)
def test_phi3_file_through_the_engine_matches_hf(tmp_path, variant, ggml_type):
    settings = {**SETTINGS, **VARIANTS[variant]}
    path = save_tiny_gguf(tmp_path / "phi3.gguf", ggml_type, "phi3", **settings)
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    if variant == "phi3-4k":
        reference = from_file
    else:
        assert from_file.config.rope_parameters["rope_type"] == "default"  # why it cannot be the reference
        reference = AutoModelForCausalLM.from_config(Phi3Config(**settings), dtype=torch.float32).eval()
        reference.load_state_dict(from_file.state_dict())
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    spec = llm.engine.runner.model.spec
    assert spec.model_type == "phi3" and spec.rotary_dim == int(32 * settings.get("partial_rotary_factor", 1.0))
    # past the original context (longrope's long factors, as HF picks them), or within the window
    lengths = (5, 17, 26) if variant == "phi3-4k" else (ORIGINAL + 1, ORIGINAL + 9, 2 * ORIGINAL + 5)
    prompts = [random_prompt(20 + i, n, VOCAB) for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    cold = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(reference, prompts, cold)
    warm = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(reference, prompts, warm)
    assert warm[2].num_cached_tokens >= lengths[2] - 4
    llm.engine.close()
