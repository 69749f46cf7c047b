"""``weight_format="gguf-int8"`` end to end on tiny GGUF models.

Two checks per model. First, that the model computes llama.cpp's arithmetic and nothing else: the same model with
every int8 linear layer replaced by the numpy reference of tests/model/test_int8_activations.py (the modules run, not
the compiled stack) scores the same sequences within 1e-4 at 80 % of positions at least, and within 0.1 at all:
the kernel and the reference sum in different orders, so an activation that lands within an fp32 rounding of a
half step can round the other way in one of them -- one code off by one, felt at that position and the later
ones of its sequence (their attention reads it), a few hundredths of a nat (measured: 100 % and 88 % of
positions within 1e-4, the rest within 0.024, one such flip). A wrong code, scale, row order or part anywhere
would move every position.

Second, what the format costs against the exact path ("gguf", which tests/model/test_gguf_native.py holds to HF):
MEAN_BOUND = 0.15 nats of mean |logprob difference|. Why: a block's activations are rounded to steps of
amax / 127, an RMS error of amax / (127 sqrt 12), about 0.7 % of the activations' RMS (amax is ~3 RMS in a block
of normal-like values); errors are independent across a dot product, so each linear output moves by ~0.7 % of
its RMS, and the ~9 linears a token passes through here (q|k|v, o, gate|up, down in 2 layers, the head) add up to
~2 % of the logits' spread, a few nats in these random models: ~0.1 nats on a logprob. Measured: 0.08 and 0.09.
Greedy: wherever the exact path's top two tokens are more than GREEDY_MARGIN apart, the int8 path must pick the
same one (the largest difference measured at any position is 1.2 nats, at flat positions of the random models).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedkv import LLM, SamplingParams, kernels
from pagedkv.model import panel
from pagedkv.model.layers import Linear
from tests.model.test_int8_activations import reference
from tests.tiny_gguf import save_tiny_gguf

pytestmark = pytest.mark.skipif(not kernels.gemm.available(), reason="the GEMM library does not build here")
PROMPTS = [[1, 40, 41, 42, 43], [1, 300, 7, 9, 270, 271, 272, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 400], [1, 5]]
MEAN_BOUND = 0.15
GREEDY_MARGIN = 1.5


def _formats(llm: LLM) -> set[str]:
    return {part.format for m in llm.engine.runner.model.modules() if isinstance(m, Linear) for part in m.panels}


def _score(llm: LLM, sequences: list[list[int]]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Per position after each sequence's first: (token, its logprob, the top 2 (token, logprob))."""
    llm.reset_prefix_cache()
    params = SamplingParams(prompt_logprobs=2, max_tokens=0)
    outputs = llm.generate(prompt_token_ids=sequences, sampling_params=params, use_tqdm=False)
    return [(e.token_id, e.logprob, list(e.top_logprobs)) for out in outputs for e in out.prompt_logprobs[1:]]


def _reference_linear(x: torch.Tensor, weight: panel.PanelWeight) -> torch.Tensor:
    code = panel.INT8_FORMATS[weight.format]  # repacked in groups of 16: the file's blocks back from them
    blocks = torch.ops.pagedkv.int8_repacked_blocks(weight.packed, torch.arange(weight.n), weight.n, weight.k, code)
    if x.shape[0] == 0:
        return x.new_zeros(0, weight.n)
    ggml_type = T(code - panel.INT8_REPACKED_BASE)
    return torch.from_numpy(reference(x.numpy(), blocks.numpy(), ggml_type, weight.k)[0].astype(np.float32))


def _score_with_the_reference(llm: LLM, sequences: list[list[int]], monkeypatch) -> list:
    """``llm`` scoring with every int8 part computed by the numpy reference (the modules, not the stack)."""
    exact_linear, exact_into = panel.panel_linear, panel.panel_linear_into

    def linear(x, weight):
        return _reference_linear(x, weight) if weight.format in panel.INT8_FORMATS else exact_linear(x, weight)

    def into(x, weight, y, col):
        if weight.format not in panel.INT8_FORMATS:
            return exact_into(x, weight, y, col)
        y[:, col : col + weight.n] = _reference_linear(x, weight)

    with monkeypatch.context() as patch:
        patch.setattr(panel, "panel_linear", linear)
        patch.setattr(panel, "panel_linear_into", into)
        patch.setattr(llm.engine.runner.model, "fused_layers", False)
        return _score(llm, sequences)


def _compare(path: Path, int8_formats: set[str], monkeypatch) -> None:
    exact = LLM(model=str(path), weight_format="gguf", num_kv_blocks=64, max_model_len=256)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = exact.generate(prompt_token_ids=PROMPTS, sampling_params=greedy, use_tqdm=False)
    sequences = [prompt + out.outputs[0].token_ids for prompt, out in zip(PROMPTS, outputs, strict=True)]
    want = _score(exact, sequences)
    exact.engine.close()
    int8 = LLM(model=str(path), weight_format="gguf-int8", num_kv_blocks=64, max_model_len=256)
    assert _formats(int8) == int8_formats
    got = _score(int8, sequences)
    assert int8.engine.runner.model._stack  # the compiled decoder stack ran the int8 parts (the reference: modules)
    arithmetic = _score_with_the_reference(int8, sequences, monkeypatch)
    int8.engine.close()
    to_reference = np.array([abs(a[1] - b[1]) for a, b in zip(got, arithmetic, strict=True)])
    assert np.mean(to_reference <= 1e-4) >= 0.8 and to_reference.max() <= 0.1, to_reference
    to_exact = np.array([abs(a[1] - b[1]) for a, b in zip(got, want, strict=True)])
    assert 0 < to_exact.mean() <= MEAN_BOUND, to_exact.mean()  # not 0: the int8 path did run, and rounds
    for (_, _, top), (_, _, top_) in zip(want, got, strict=True):
        if top[0][1] - top[1][1] > GREEDY_MARGIN:
            assert top_[0][0] == top[0][0], (top, top_)


def test_a_q4_k_m_mix_with_biases_and_a_tied_q8_0_head(tmp_path, monkeypatch):
    """q, k Q4_K and v Q6_K in one fused layer (both repacked), Qwen2's biases, the tied Q8_0 head (the
    embedding's rows then read from its blocks)."""
    path = save_tiny_gguf(
        tmp_path / "mix.gguf",
        T.Q4_K,
        "qwen2",
        part_types={"attn_v": T.Q6_K, "ffn_down": T.Q6_K},
        embedding_type=T.Q8_0,
        tie_word_embeddings=True,
    )
    _compare(path, {"int8-q4_k-x16", "int8-q6_k-x16", "int8-q8_0-x16"}, monkeypatch)


def test_a_tied_q6_k_head_repacked_serves_the_embedding_too(tmp_path, monkeypatch):
    """Llama-3.2-1B's Q4_K_M layout: the tied Q6_K head is repacked, and the embedding's rows are unpacked from it."""
    path = save_tiny_gguf(tmp_path / "tied.gguf", T.Q4_K, embedding_type=T.Q6_K, tie_word_embeddings=True)
    _compare(path, {"int8-q4_k-x16", "int8-q6_k-x16"}, monkeypatch)


def test_the_legacy_types_with_llamas_interleaved_rows(tmp_path, monkeypatch):
    """Q4_1 (the default model's type), Q4_0, Q5_0 and Q8_0, llama architecture (q/k rows reordered at load)."""
    path = save_tiny_gguf(
        tmp_path / "legacy.gguf", T.Q4_1, part_types={"attn_v": T.Q5_0, "ffn_down": T.Q8_0, "ffn_up": T.Q4_0}
    )
    _compare(path, {"int8-q4_1-x16", "int8-q5_0-x16", "int8-q8_0-x16", "int8-q4_0-x16"}, monkeypatch)


def test_a_type_without_an_int8_kernel_stays_exact_and_says_so(tmp_path, caplog):
    """A Q5_K tensor is packed for the exact panel GEMM, with a log line naming it; the others go int8."""
    path = save_tiny_gguf(tmp_path / "q5k.gguf", T.Q4_K, part_types={"ffn_up": T.Q5_K})
    with caplog.at_level(logging.INFO, logger="pagedkv.model.int8_linear"):
        llm = LLM(model=str(path), weight_format="gguf-int8", num_kv_blocks=16, max_model_len=64)
    assert _formats(llm) == {"int8-q4_k-x16", "q5k"}
    llm.engine.close()
    assert "'blk.0.ffn_up.weight' is Q5_K, which has no int8-activation kernel" in caplog.text
