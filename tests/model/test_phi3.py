"""Phi-3 / Phi-3.5 / Phi-4-mini (HF ``Phi3ForCausalLM``) against HF transformers, on tiny random models.

What differs from Llama: the checkpoint fuses q|k|v and gate|up into one tensor each (split at load into the
model's own fused layers), long-context ``longrope`` RoPE (short and long per-pair factors and a cos/sin
attention factor), Phi-4-mini's partial rotary (3/4 of each head rotated) and tied embeddings, and Phi-3-mini-4k's
sliding window over the whole context. The tiny models set each of these; at TP=2 each rank takes its rows of
every fused part.

Longrope's factor set is chosen once per engine (rope_scaling.py): long when max_model_len exceeds the original
context, which HF also uses for a forward over a sequence longer than that; short when max_model_len is within
it, as HF for any sequence within it. So each rule is compared with HF on sequences where HF chooses the same:
all longer than the original context for the long set, all within it for the short one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config

from pagedkv import LLM, SamplingParams, kernels
from pagedkv.attention.paged import KernelAttention
from pagedkv.model.decoder_stack import DecoderStack
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.spec import ModelSpec, UnsupportedModelError
from tests.hf_reference import TINY_SHAPE, TOL, check_against_hf, hf_logits, random_prompt, save_with_word_tokenizer

VOCAB = 256
ORIGINAL = 48  # original_max_position_embeddings of the long-context models
needs_kernels = pytest.mark.skipif(not kernels.portable.available(), reason="the compiled kernels cannot be built")


def _config(variant: str) -> Phi3Config:
    """``phi3-4k``: default RoPE, a window of 40 over the whole context; ``phi3.5``: longrope, whole heads;
    ``phi4-mini``: longrope on 3/4 of each head, tied embeddings (the real models' shapes, tiny)."""
    settings = dict(
        vocab_size=VOCAB,
        **TINY_SHAPE,
        max_position_embeddings=4 * ORIGINAL,
        rope_theta=500.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if variant == "phi3-4k":
        return Phi3Config(**settings, sliding_window=40)
    partial = 0.75 if variant == "phi4-mini" else 1.0
    pairs = int(32 * partial) // 2
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.0 + 0.9 * i for i in range(pairs)],
    }
    return Phi3Config(
        **settings,
        rope_scaling=scaling,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
        tie_word_embeddings=variant == "phi4-mini",
    )


def _hf_model(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(variant), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf


def _ours(hf: torch.nn.Module, max_model_len: int | None = None, **options) -> LlamaForCausalLM:
    model = LlamaForCausalLM(hf.config, max_model_len=max_model_len, **options)
    model.load_weights(dict(hf.state_dict()))
    return model


@pytest.fixture(scope="module", params=["phi3-4k", "phi3.5", "phi4-mini"])
def hf(request) -> torch.nn.Module:
    return _hf_model(request.param)


def test_spec_reads_every_phi3_field():
    four_k, mini = (ModelSpec.from_hf_config(_config(v)) for v in ("phi3-4k", "phi4-mini"))
    assert four_k.fused_checkpoint and four_k.max_model_len == 40 and four_k.rotary_dim == 32
    assert mini.rotary_dim == 24 and mini.tie_word_embeddings and mini.rope["long_context"]
    assert not ModelSpec.from_hf_config(_config("phi4-mini"), max_model_len=ORIGINAL).rope["long_context"]


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_logits_match_hf_with_each_factor_set(hf, paged_harness, block_size):
    long_prompt, short_prompt = random_prompt(1, 2 * ORIGINAL + 3, VOCAB), random_prompt(2, ORIGINAL - 8, VOCAB)
    if hf.config.sliding_window:  # Phi-3-mini-4k: the window caps the context
        long_prompt = long_prompt[: hf.config.sliding_window]
    (logits,) = paged_harness(_ours(hf), block_size).step([("a", long_prompt)])
    torch.testing.assert_close(logits, hf_logits(hf, long_prompt), atol=TOL, rtol=0)
    (logits,) = paged_harness(_ours(hf, max_model_len=ORIGINAL), block_size).step([("a", short_prompt)])
    torch.testing.assert_close(logits, hf_logits(hf, short_prompt), atol=TOL, rtol=0)


def test_the_factor_sets_differ(paged_harness):
    """The tests can fail: with the long factors (a max_model_len past the original context), a prompt within
    the original context is far from HF's, which rotates it with the short ones."""
    hf = _hf_model("phi4-mini")
    prompt = random_prompt(3, ORIGINAL - 8, VOCAB)
    (logits,) = paged_harness(_ours(hf, max_model_len=2 * ORIGINAL), 16).step([("a", prompt)])
    assert (logits - hf_logits(hf, prompt)).abs().max() > 100 * TOL


@needs_kernels
@pytest.mark.parametrize("variant", ["phi3.5", "phi4-mini"])
def test_compiled_kernels_match_hf(variant, paged_harness):
    """Compiled RoPE on whole heads and on a strided part of each (Phi-4-mini), both in the decoder stack."""
    hf = _hf_model(variant)
    model = _ours(hf, attention=KernelAttention())
    model.use_kernels()
    a, b = random_prompt(4, 2 * ORIGINAL + 1, VOCAB), random_prompt(5, ORIGINAL + 9, VOCAB)
    harness = paged_harness(model, block_size=4, seed=9)
    first = harness.step([("a", a[:10]), ("b", b)])
    assert isinstance(model._stack, DecoderStack)
    second = harness.step([("a", a[10:]), ("b", [7])])
    torch.testing.assert_close(second[0], hf_logits(hf, a)[10:], atol=TOL, rtol=0)
    torch.testing.assert_close(second[1], hf_logits(hf, b + [7])[-1:], atol=TOL, rtol=0)
    torch.testing.assert_close(first[1], hf_logits(hf, b), atol=TOL, rtol=0)


# -- the whole engine: a checkpoint on disk, chunked prefill, batches and prefix-cache hits --------------------


@pytest.fixture(scope="module")
def checkpoint(hf, tmp_path_factory) -> str:
    return save_with_word_tokenizer(hf, tmp_path_factory.mktemp("tiny-phi3"))


@pytest.mark.parametrize("rule", ["long", "short"])
def test_engine_greedy_matches_hf_chunked_batched_and_from_the_prefix_cache(hf, checkpoint, rule):
    """Three prompts in one batch, chunked at 16 tokens a step, twice (the second pass hits the prefix cache).
    ``long``: the model's own max_model_len, every sequence longer than the original context; ``short``:
    max_model_len = the original context, every sequence within it."""
    window = hf.config.sliding_window
    if rule == "short":
        max_model_len, lengths = ORIGINAL, (5, 17, 30)
    elif window:  # Phi-3-mini-4k: no factor sets, the window caps the context
        max_model_len, lengths = None, (5, 17, window - 10)
    else:
        max_model_len, lengths = None, (ORIGINAL + 1, ORIGINAL + 9, 2 * ORIGINAL + 5)
    llm = LLM(
        model=checkpoint,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=16,
        weight_format="float32",
        max_model_len=max_model_len,
    )
    prompts = [random_prompt(10 + i, n, VOCAB) for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    cold = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(hf, prompts, cold)
    warm = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(hf, prompts, warm)
    assert warm[2].num_cached_tokens >= lengths[2] - 4
    llm.engine.close()


# -- refused by name ------------------------------------------------------------------------------------------


def test_factor_lists_of_the_wrong_length_are_refused_by_name():
    config = _config("phi4-mini")
    config.rope_parameters["long_factor"] = config.rope_parameters["long_factor"][:-1]
    with pytest.raises(UnsupportedModelError, match="long_factor has 11 values"):
        ModelSpec.from_hf_config(config)


def test_an_unknown_rope_type_is_refused_by_name():
    config = _config("phi3.5")
    config.rope_parameters["rope_type"] = "dynamic"
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        ModelSpec.from_hf_config(config)


def test_longrope_without_factors_is_refused_by_name():
    config = _config("phi3.5")
    del config.rope_parameters["short_factor"]
    with pytest.raises(UnsupportedModelError, match="short_factor"):
        ModelSpec.from_hf_config(config)


def test_a_fused_tensor_of_the_wrong_size_is_refused_by_name():
    hf = _hf_model("phi3.5")
    weights = dict(hf.state_dict())
    weights["model.layers.1.self_attn.qkv_proj.weight"] = weights["model.layers.1.self_attn.qkv_proj.weight"][:-4]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj has 252 rows"):
        LlamaForCausalLM(hf.config).load_weights(weights)


@pytest.mark.slow
def test_tensor_parallel_takes_each_ranks_rows_of_every_fused_part(tmp_path):
    """At TP=2 each rank loads its query and KV heads' rows of q, k and v out of the one qkv_proj tensor (and
    its rows of gate and up out of gate_up_proj); slicing the fused tensor itself would hand rank 0 all of q.
    Phi-4-mini's shape: partial rotary, longrope, tied embeddings. Sums over ranks differ in the last bits."""
    hf = _hf_model("phi4-mini")
    checkpoint = save_with_word_tokenizer(hf, tmp_path / "tiny-phi4-mini")
    llm = LLM(model=checkpoint, tensor_parallel_size=2, num_kv_blocks=64, num_threads=1, weight_format="float32")
    prompts = [random_prompt(40 + i, n, VOCAB) for i, n in enumerate((ORIGINAL + 3, 2 * ORIGINAL))]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    llm.engine.close()
    check_against_hf(hf, prompts, outputs, tol=2e-4)
