"""Gemma 3 (text) against HF transformers, on a tiny random model with a window of 8 tokens.

What differs from the Llama decoder is data in ``ModelSpec`` (``x * (1 + w)`` norms, GeLU-tanh, sqrt(hidden)
embedding scale, q/k norms, ``query_pre_attn_scalar``, four norms a layer, per-layer windows and RoPE bases);
each is exercised here because the tiny model sets every one of them away from the Llama value. Prompts are
shorter than, equal to and 3x the window, prefilled whole, in chunks, mixed with decodes, and through the
engine with prefix-cache hits; pools start as NaN, so a read of an unwritten slot shows.

Windowed layers release the blocks that slid out of their window: docs/sliding-window.md, tested in
test_sliding_window_kv.py (tensor parallelism and kv_cache_dir still keep every block).

Elsewhere: the ``gemma3`` GGUF architecture in test_gemma3_gguf.py; the real 270M Q4_K_M file against HF,
a ~1,900-token nine-turn conversation included, in test_gemma3_real.py (opt-in: ``make test-gemma3``) and
``benchmarks/gemma3_long.py`` (which also prints the KV a 4,096-token request holds); its speed in
docs/models-gemma3-speed.md.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from pagedkv import LLM, SamplingParams, kernels
from pagedkv.attention.paged import KernelAttention
from pagedkv.model.decoder_stack import DecoderStack
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.spec import ModelSpec, UnsupportedModelError
from tests.hf_reference import check_against_hf, hf_logits, random_prompt, save_with_word_tokenizer

TOL = 1e-4
WINDOW = 8
VOCAB = 256
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _config(**overrides) -> Gemma3TextConfig:
    """Every Gemma-specific number away from its Llama value: a softmax scale not head_dim ** -0.5, local and
    global RoPE bases far apart, windowed layers on both sides of a full one."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        query_pre_attn_scalar=20,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    settings.update(overrides)
    return Gemma3TextConfig(**settings)


def _hf_model(config: Gemma3TextConfig) -> torch.nn.Module:
    """HF's model, fp32, weights large enough that logits are far from ties (norm weights around 0: Gemma's
    norms scale by 1 + w)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, LlamaForCausalLM]:
    hf = _hf_model(_config())
    ours = LlamaForCausalLM(hf.config)
    ours.load_weights(dict(hf.state_dict()))
    return hf, ours


def _prompt(seed: int, length: int) -> list[int]:
    return random_prompt(seed, length, VOCAB)


def test_spec_reads_every_gemma_field(pair):
    spec = pair[1].spec
    assert spec.layer_windows == (WINDOW, WINDOW, 0, WINDOW)
    assert spec.local_rope["rope_theta"] == 50.0 and spec.rope["rope_theta"] == 10000.0
    assert (spec.activation, spec.norm_offset, spec.sandwich_norms, spec.qk_norm) == ("gelu_tanh", 1.0, True, True)
    assert spec.embed_scale == pytest.approx(8.0) and spec.softmax_scale == pytest.approx(20**-0.5)
    assert spec.max_model_len == 256  # the window does not cap the context


@pytest.mark.parametrize("length", [5, WINDOW, 3 * WINDOW, 5 * WINDOW + 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_logits_match_hf(pair, paged_harness, length, block_size):
    hf, ours = pair
    prompt = _prompt(length, length)
    (logits,) = paged_harness(ours, block_size).step([("a", prompt)])
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=TOL, rtol=0)


def test_the_window_changes_the_logits(pair, paged_harness):
    """The test above can fail: the same weights with every layer attending to the whole context are far off."""
    hf, ours = pair
    full = LlamaForCausalLM(hf.config)
    full.load_weights(dict(hf.state_dict()))
    for layer in full.layers:
        layer.self_attn.window = 0
    prompt = _prompt(1, 3 * WINDOW)
    (logits,) = paged_harness(full, 4).step([("a", prompt)])
    reference = hf_logits(hf, prompt)
    assert (logits[:WINDOW] - reference[:WINDOW]).abs().max() < TOL  # within the window: the same
    assert (logits[WINDOW:] - reference[WINDOW:]).abs().max() > 100 * TOL


def test_chunked_prefill_matches_hf(pair, paged_harness):
    """Chunks that start inside, at and past a window's width of earlier context."""
    hf, ours = pair
    prompt = _prompt(2, 41)
    harness = paged_harness(ours, block_size=4, seed=3)
    chunks = [harness.step([("a", part)])[0] for part in (prompt[:3], prompt[3:11], prompt[11:12], prompt[12:])]
    torch.testing.assert_close(torch.cat(chunks), hf_logits(hf, prompt), atol=TOL, rtol=0)


def test_mixed_step_matches_hf(pair, paged_harness):
    """Decodes past the window, a continued chunk and a fresh prompt in ONE step."""
    hf, ours = pair
    a, b, c, d = _prompt(3, 20), _prompt(4, 6), _prompt(5, 30), _prompt(6, 13)
    mixed = paged_harness(ours, block_size=4, seed=5)
    mixed.step([("a", a[:-1]), ("b", b[:-1]), ("c", c[:12])])
    got = mixed.step([("a", a[-1:]), ("b", b[-1:]), ("c", c[12:]), ("d", d)])
    for mine, tokens in zip(got, (a, b, c, d), strict=True):
        torch.testing.assert_close(mine, hf_logits(hf, tokens)[-len(mine) :], atol=TOL, rtol=0)


def test_greedy_decode_matches_hf_generate(pair, paged_harness):
    hf, ours = pair
    prompts = {"a": _prompt(7, 5), "b": _prompt(8, 19), "c": _prompt(9, 3 * WINDOW)}
    steps = 2 * WINDOW
    ours_out = paged_harness(ours, block_size=4, seed=7).greedy(prompts, steps=steps)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
        assert ours_out[rid] == seq[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)
def test_unsupported_fields_are_refused_by_name(override, field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelSpec.from_hf_config(_config(**override))


def test_kernel_backend_and_decoder_stack_match_hf(pair, paged_harness):
    """The compiled attention kernel with the window, compiled norms and RoPE, every layer in the compiled
    decoder stack (four norms, GeLU-tanh, two RoPE tables: model/decoder_stack.py)."""
    if not kernels.portable.available():
        pytest.skip("the compiled kernels cannot be built here")
    hf, _ = pair
    model = LlamaForCausalLM(hf.config, attention=KernelAttention())
    model.load_weights(dict(hf.state_dict()))
    model.use_kernels()
    a, b = _prompt(30, 3 * WINDOW + 1), _prompt(31, 6)
    harness = paged_harness(model, block_size=4, seed=9)
    first = harness.step([("a", a[:10]), ("b", b)])
    assert isinstance(model._stack, DecoderStack)
    second = harness.step([("a", a[10:]), ("b", [7])])
    torch.testing.assert_close(first[0], hf_logits(hf, a[:10]), atol=TOL, rtol=0)
    torch.testing.assert_close(first[1], hf_logits(hf, b), atol=TOL, rtol=0)
    torch.testing.assert_close(second[0], hf_logits(hf, a)[10:], atol=TOL, rtol=0)
    torch.testing.assert_close(second[1], hf_logits(hf, b + [7])[-1:], atol=TOL, rtol=0)


# -- the whole engine: a checkpoint on disk, chunked prefill, batches and prefix-cache hits --------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, pair) -> str:
    return save_with_word_tokenizer(pair[0], tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.mark.parametrize("backend", ["gather", "kernel"])
def test_engine_greedy_and_logprobs_match_hf_with_chunks_and_prefix_hits(pair, checkpoint, backend):
    """Prompts of 5 to 3x the window and past it, chunked at 16 tokens a step, twice: the second pass hits
    the prefix cache (blocks written by the first) and must give the same tokens and HF's logprobs."""
    if backend == "kernel" and not kernels.portable.available():
        pytest.skip("the compiled kernels cannot be built here")
    hf, _ = pair
    llm = LLM(
        model=checkpoint,
        attention_backend=backend,
        block_size=4,
        num_kv_blocks=96,
        max_num_batched_tokens=16,
        weight_format="float32",
    )
    assert llm.engine.attention.name == backend
    prompts = [_prompt(20, 5), _prompt(21, WINDOW), _prompt(22, 3 * WINDOW), _prompt(23, 45)]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    cold = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(hf, prompts, cold)
    warm = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(hf, prompts, warm)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    assert warm[3].num_cached_tokens >= 40  # the long prompt's full blocks came from the cache
    llm.engine.close()
