"""GGUF files read natively: every supported tensor type, computed on its own codes, against HF transformers
loading the same file (which de-quantises every tensor to fp32 with the gguf package's numpy code).

The models are tiny and random (tests/tiny_gguf.py), in each type alone and mixed as a Q4_K_M file mixes them.
The reference is teacher-forced: HF scores our generated tokens in one forward pass, so every step of ours is
compared with HF's logprobs at the same position (within 1e-4), and each greedy token must be HF's argmax
unless HF's top two are closer than that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedkv import LLM, SamplingParams, kernels
from pagedkv.model.gguf_blocks import TYPES
from pagedkv.model.layers import Linear
from tests.tiny_gguf import K_SCALES, LEGACY, save_tiny_gguf

needs_gemm = pytest.mark.skipif(not kernels.gemm.available(), reason="the panel GEMM could not be built here")
PROMPTS = [[1, 40, 41, 42, 43], [1, 300, 7, 9, 270, 271, 272, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 400], [1, 5]]
MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
Q4_K_M_MIX = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K}  # what llama.cpp's Q4_K_M puts in more bits


def _hf_logprobs(directory: Path, name: str, sequence: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([sequence])).logits[0].double(), dim=-1)


def _panel_formats(llm: LLM) -> set[str]:
    """The panel formats the model's linear layers compute on (empty: none packed, torch's GEMM)."""
    return {part.format for m in llm.engine.runner.model.modules() if isinstance(m, Linear) for part in m.panels}


def _check_against_hf(path: Path, formats: set[str], **options: object) -> None:
    """Ours equal HF's, with the linear layers computing on ``formats`` (as packed from the file's types)."""
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, **options)
    assert _panel_formats(llm) == formats
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    llm.engine.close()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        reference = _hf_logprobs(path.parent, path.name, prompt + tokens)
        for step, token in enumerate(tokens):
            row = reference[len(prompt) + step - 1]
            ours = output.outputs[0].logprobs[step]
            assert abs(ours - row[token].item()) <= LOGPROB_TOLERANCE, (step, ours, row[token].item())
            top2 = torch.topk(row, 2).values
            assert token == row.argmax().item() or top2[0] - top2[1] < LOGPROB_TOLERANCE, (step, token)


@needs_gemm
@pytest.mark.parametrize("ggml_type", [*LEGACY, *K_SCALES], ids=lambda t: t.name)
def test_every_type_matches_hf(tmp_path, ggml_type):
    """Each type alone (the embedding too), llama architecture (its q/k rows come interleaved in the file)."""
    path = save_tiny_gguf(tmp_path / f"{ggml_type.name}.gguf", ggml_type)
    _check_against_hf(path, {TYPES[ggml_type].panel_format})


@needs_gemm
def test_a_q4_k_m_mix_with_qwen2_biases_and_a_tied_head_matches_hf(tmp_path):
    """Types mixed within a fused layer (q, k Q4_K; v Q6_K), Qwen2's q/k/v biases, and a tied Q8_0 head."""
    path = save_tiny_gguf(
        tmp_path / "mix.gguf", T.Q4_K, "qwen2", part_types=Q4_K_M_MIX, embedding_type=T.Q8_0, tie_word_embeddings=True
    )
    _check_against_hf(path, {"q4k", "q6k", "q8"})


def test_float32_reference_and_kernels_off_match_hf(tmp_path):
    """weight_format='float32' (de-quantised once, in memory) and 'gguf' without the kernels (which falls back to
    the same) compute the same model."""
    path = save_tiny_gguf(tmp_path / "q5_k.gguf", T.Q5_K, part_types={"ffn_up": T.Q4_0})
    _check_against_hf(path, set(), weight_format="float32", kernels=False)
    _check_against_hf(path, set(), kernels=False)
