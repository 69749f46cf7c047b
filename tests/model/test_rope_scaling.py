"""RoPE context scaling (pagedkv/model/rope_scaling.py) against HF transformers.

Unit level: the inverse frequencies and the cos/sin attention factor of every supported ``rope_type`` equal
those of transformers' own ``ROPE_INIT_FUNCTIONS`` for the same config (yarn in each of its attention-factor
forms and with and without truncation, Llama 3.x, linear, longrope's two factor sets, a partial rotary head).
End to end: tiny random Qwen2 (YaRN, q/k/v biases) and Llama (Llama 3.x scaling) models through the engine,
chunked, batched, cold and warm in the prefix cache, greedy tokens and logprobs equal to HF's; a Llama 3 GGUF
file, whose scaling is a tensor of divisors. Phi-3's longrope end to end is in test_phi3.py.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedkv import LLM, SamplingParams
from pagedkv.model import gguf_rope
from pagedkv.model.gguf_file import GGUFError
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.model.rope_scaling import rope_frequencies
from pagedkv.model.spec import ModelSpec, UnsupportedModelError
from tests.hf_reference import TINY_SHAPE, check_against_hf, hf_logits, random_prompt, save_with_word_tokenizer
from tests.tiny_gguf import save_tiny_gguf

VOCAB = 256
ORIGINAL = 32  # the tiny models' "pre-training" context: prompts run past it


def _qwen2(rope_scaling: dict | None, **overrides) -> Qwen2Config:
    settings = dict(
        vocab_size=VOCAB,
        **TINY_SHAPE,
        max_position_embeddings=4 * ORIGINAL,
        rope_theta=500.0,  # a small base: long wavelengths fit the tiny context, so scaling moves the logits
        rope_scaling=rope_scaling,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return Qwen2Config(**settings)


def _llama3(**overrides) -> LlamaConfig:
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
    settings = dict(
        vocab_size=VOCAB,
        **TINY_SHAPE,
        max_position_embeddings=128,
        rope_theta=500.0,
        rope_scaling=scaling,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def _phi3_longrope(partial: float) -> Phi3Config:
    pairs = int(32 * partial) // 2
    return Phi3Config(
        vocab_size=VOCAB,
        **TINY_SHAPE,
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
        pad_token_id=0,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [1.0 + 0.7 * i for i in range(pairs)],
        },
    )


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
CONFIGS = {
    "yarn": _qwen2(YARN),
    "yarn-no-truncate-betas": _qwen2({**YARN, "truncate": False, "beta_fast": 16, "beta_slow": 2}),
    "yarn-mscale": _qwen2({**YARN, "mscale": 0.8, "mscale_all_dim": 0.5}),
    "yarn-attention-factor": _qwen2({**YARN, "attention_factor": 1.3}),
    "linear": _qwen2({"rope_type": "linear", "factor": 2.5}),
    "llama3": _llama3(),
    "longrope": _phi3_longrope(1.0),
    "longrope-partial": _phi3_longrope(0.75),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("long_context", [False, True])
def test_frequencies_and_attention_factor_equal_transformers(name, long_context):
    config = CONFIGS[name]
    rope_type = config.rope_parameters["rope_type"]
    # HF's longrope picks its factor set from the sequence length; ours from the engine's max_model_len
    seq_len = ORIGINAL + 1 if long_context else ORIGINAL
    theirs, their_factor = ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)
    spec = ModelSpec.from_hf_config(config, None if long_context else ORIGINAL)
    if rope_type == "longrope":
        assert spec.rope["long_context"] is long_context
    ours, our_factor = rope_frequencies(spec.rotary_dim, spec.rope, config.max_position_embeddings)
    assert ours.shape == theirs.shape == (spec.rotary_dim // 2,)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)


def test_scaling_changes_the_frequencies():
    """The comparison above can fail: each scaled type differs from unscaled RoPE on the same base."""
    plain, _ = rope_frequencies(32, {"rope_type": "default", "rope_theta": 500.0}, 4 * ORIGINAL)
    for name in ("yarn", "linear", "llama3"):
        spec = ModelSpec.from_hf_config(CONFIGS[name])
        scaled, _ = rope_frequencies(32, spec.rope, 4 * ORIGINAL)
        assert (scaled - plain).abs().max() > 1e-3, name
    yarn = ModelSpec.from_hf_config(CONFIGS["yarn"])
    assert rope_frequencies(32, yarn.rope, 4 * ORIGINAL)[1] > 1.1  # 0.1 ln 4 + 1


# -- end to end: the whole engine against HF ------------------------------------------------------------------


def _hf_model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module", params=["yarn", "llama3"])
def scaled(request, tmp_path_factory) -> tuple[torch.nn.Module, str]:
    hf = _hf_model(CONFIGS[request.param])
    return hf, save_with_word_tokenizer(hf, tmp_path_factory.mktemp(f"tiny-{request.param}"))


def test_prefill_logits_match_hf(scaled, paged_harness):
    hf, _ = scaled
    ours = LlamaForCausalLM(hf.config)
    ours.load_weights(dict(hf.state_dict()))
    prompt = random_prompt(1, 3 * ORIGINAL, VOCAB)
    (logits,) = paged_harness(ours, block_size=4).step([("a", prompt)])
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_engine_greedy_matches_hf_chunked_batched_and_from_the_prefix_cache(scaled):
    """Prompts inside and past the original context, chunked at 16 tokens a step, in one batch, twice: the
    second pass reads the first one's blocks from the prefix cache and must give HF's numbers again."""
    hf, checkpoint = scaled
    llm = LLM(model=checkpoint, block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, weight_format="float32")
    prompts = [random_prompt(seed, length, VOCAB) for seed, length in ((2, 5), (3, ORIGINAL), (4, 3 * ORIGINAL + 1))]
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, ignore_eos=True)
    cold = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(hf, prompts, cold)
    warm = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(hf, prompts, warm)
    assert warm[2].num_cached_tokens >= 3 * ORIGINAL - 4
    llm.engine.close()


def test_rope_tables_hold_the_engines_max_model_len_not_max_position_embeddings(tmp_path):
    """A 131,072-position longrope config (Phi-3-mini-128k's length; its tables took ~100 MB) served with
    max_model_len 64: the tables hold 64 rows, the same bits as the leading rows of a table sized by
    max_position_embeddings (longrope's attention factor still comes from the config's length), and a request
    that fills the 64 positions gives HF's tokens and logprobs."""
    config = copy.deepcopy(CONFIGS["longrope-partial"])
    config.max_position_embeddings = 131072
    hf = _hf_model(config)
    llm = LLM(model=save_with_word_tokenizer(hf, tmp_path), max_model_len=64, block_size=4, num_kv_blocks=32)
    model = llm.engine.runner.model
    spec = model.spec
    assert spec.max_model_len == 64 and spec.max_positions == 131072
    whole = RotaryEmbedding(spec.rotary_dim, 131072, spec.rope, spec.max_positions)
    served = model.rotary[0]
    assert served.cos.shape == served.sin_signed.shape == (64, spec.rotary_dim)
    assert torch.equal(served.cos, whole.cos[:64]) and torch.equal(served.sin_signed, whole.sin_signed[:64])
    prompt = random_prompt(5, 60, VOCAB)  # past the original 32: the long factors and a large attention factor
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    assert len(prompt) + len(outputs[0].outputs[0].token_ids) == 64
    check_against_hf(hf, [prompt], outputs)
    llm.engine.close()


def test_a_rope_table_longer_than_max_position_embeddings_is_refused():
    with pytest.raises(ValueError, match="1 to max_position_embeddings"):
        RotaryEmbedding(32, 129, {"rope_type": "default", "rope_theta": 500.0}, 128)


# -- refused by name ------------------------------------------------------------------------------------------


def test_dynamic_ntk_is_refused_by_name():
    config = _qwen2({"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        ModelSpec.from_hf_config(config)


def test_partial_rotary_factor_is_refused_where_hf_rotates_whole_heads():
    config = _qwen2(None)
    config.rope_parameters["partial_rotary_factor"] = 0.5
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        ModelSpec.from_hf_config(config)


def test_yarn_without_its_original_context_is_refused_by_name():
    config = _qwen2(dict(YARN))
    del config.rope_parameters["original_max_position_embeddings"]
    with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings"):
        ModelSpec.from_hf_config(config)


# -- GGUF: Llama 3's scaling, stored by llama.cpp as one divisor a pair (rope_freqs.weight) ---------------------

LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def test_a_llama3_gguf_file_runs_with_its_rope_freqs(tmp_path):
    """transformers' GGUF conversion leaves rope_freqs out (it loads the file with plain RoPE), so the reference
    is HF's Llama with the scaling the file was written from, holding the weights HF de-quantised from it."""
    path = save_tiny_gguf(tmp_path / "llama3.gguf", T.Q8_0, "llama", rope_theta=500000.0, rope_scaling=LLAMA3)
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert from_file.config.rope_parameters["rope_type"] == "default"
    config = copy.deepcopy(from_file.config)
    config.rope_parameters = {**LLAMA3, "rope_theta": 500000.0}
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.load_state_dict(from_file.state_dict())
    prompts = [random_prompt(30 + i, n, 512) for i, n in enumerate((5, 40, 90))]
    scaled_away = hf_logits(reference, prompts[2]) - hf_logits(from_file, prompts[2])
    assert scaled_away.abs().max() > 100 * 1e-4  # the check below can fail: plain RoPE is far off
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=128, max_num_batched_tokens=16)
    assert llm.engine.runner.model.spec.rope["factor"] == 8.0
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    check_against_hf(reference, prompts, llm.generate(prompt_token_ids=prompts, sampling_params=params))
    llm.engine.close()


def test_rope_freqs_that_are_not_llama3s_are_refused_by_name(tmp_path):
    other = {**LLAMA3, "low_freq_factor": 2.0}
    path = save_tiny_gguf(tmp_path / "other.gguf", T.Q8_0, "llama", rope_theta=500000.0, rope_scaling=other)
    with pytest.raises(GGUFError, match="rope_freqs.weight"):
        LLM(model=str(path), num_kv_blocks=16)


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_rope_scaling_keys_of_a_gguf_file_are_refused_by_name(kind):
    """transformers' conversion would drop them: the file would run with plain RoPE."""
    file = SimpleNamespace(architecture="qwen2", metadata={"qwen2.rope.scaling.type": kind}, tensors={}, path="q.gguf")
    with pytest.raises(GGUFError, match=f"qwen2.rope.scaling.type='{kind}'"):
        gguf_rope.complete_config(file, _qwen2(None))
