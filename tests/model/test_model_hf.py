"""Our Llama-family model on the paged pool against HF transformers (fp32), on tiny random models.

Each tiny model is built from a transformers config (no download), HF's weights are copied into ours, and
our model runs through hand-built, shuffled block tables over pools filled with NaN: any read of a slot
that was never written would turn the logits into NaN.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedkv import kernels
from pagedkv.attention.paged import KernelAttention
from pagedkv.model.layers import LMHead
from pagedkv.model.llama import LlamaForCausalLM

TOL = 1e-4


def _tiny_config(kind: str):
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "llama3-rope-bias-tied":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True, rope_parameters=rope)
    if kind == "mistral":  # the Llama decoder under its own model_type (a window only caps the context)
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    raise ValueError(kind)


KINDS = ["llama", "llama3-rope-bias-tied", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    """(HF model, our model with HF's weights), fp32; weights large enough that logits are far from ties."""
    config = _tiny_config(request.param)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    ours = LlamaForCausalLM(config)
    ours.load_weights(dict(hf.state_dict()))
    return hf, ours


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_logits_match_hf(pair, block_size, paged_harness):
    hf, ours = pair
    prompt = _prompt(1, 37)
    (logits,) = paged_harness(ours, block_size).step([("a", prompt)])
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=TOL, rtol=0)


def test_chunked_prefill_equals_unchunked(pair, paged_harness):
    hf, ours = pair
    prompt = _prompt(2, 41)
    harness = paged_harness(ours, block_size=4, seed=3)
    chunks = [harness.step([("a", part)])[0] for part in (prompt[:7], prompt[7:30], prompt[30:])]
    (whole,) = paged_harness(ours, block_size=4, seed=4).step([("a", prompt)])
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, _hf_logits(hf, prompt), atol=TOL, rtol=0)


def test_mixed_step_equals_separate_runs(pair, paged_harness):
    """Two decodes, a continued prefill chunk and a fresh prefill in ONE step, against each run alone."""
    hf, ours = pair
    a, b, c, d = _prompt(3, 20), _prompt(4, 9), _prompt(5, 30), _prompt(6, 13)
    mixed = paged_harness(ours, block_size=4, seed=5)
    mixed.step([("a", a[:-1]), ("b", b[:-1]), ("c", c[:12])])
    got = mixed.step([("a", a[-1:]), ("b", b[-1:]), ("c", c[12:]), ("d", d)])
    alone = []
    for rid, prefix, new in (
        ("a", a[:-1], a[-1:]),
        ("b", b[:-1], b[-1:]),
        ("c", c[:12], c[12:]),
        ("d", [], d),
    ):
        harness = paged_harness(ours, block_size=4, seed=6)
        if prefix:
            harness.step([(rid, prefix)])
        alone += harness.step([(rid, new)])
    for mine, ref in zip(got, alone, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=0)
    for mine, tokens in zip(got, (a, b, c, d), strict=True):
        torch.testing.assert_close(mine, _hf_logits(hf, tokens)[-len(mine) :], atol=TOL, rtol=0)


def test_greedy_decode_matches_hf_generate(pair, paged_harness):
    hf, ours = pair
    prompts = {"a": _prompt(7, 5), "b": _prompt(8, 19), "c": _prompt(9, 11)}
    ours_out = paged_harness(ours, block_size=4, seed=7).greedy(prompts, steps=10)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert ours_out[rid] == seq[0, len(prompt) :].tolist()


def test_kernel_backend_matches_gather(pair, paged_harness):
    """The same mixed steps with all attention on the compiled kernel (skipped where it cannot build)."""
    if not kernels.portable.available():
        pytest.skip("the C++ attention kernel cannot be built here")
    hf, ours = pair
    on_kernel = LlamaForCausalLM(hf.config, attention=KernelAttention())
    on_kernel.load_weights(dict(hf.state_dict()))
    prompts = {"a": _prompt(10, 6), "b": _prompt(11, 21)}
    runs = [paged_harness(model, block_size=4, seed=8) for model in (ours, on_kernel)]
    for harness in runs:
        harness.step(list(prompts.items()))
    for token in (5, 77, 130):
        ref, got = (h.step([("a", [token]), ("b", [token]), ("c", _prompt(token, 9))]) for h in runs)
        for mine, theirs in zip(got, ref, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_bad_checkpoint_names_are_rejected(pair):
    _, ours = pair
    state = {"model.layers.0.mlp.gate_proj.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="missing weights"):
        ours.load_weights(state)


# -- the default model (SmolLM2-135M-Instruct GGUF) through our loader, against HF's own GGUF load --------

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a hash table is.",
]


@pytest.fixture(scope="module")
def chat_prompts(hf_default_tokenizer) -> list[list[int]]:
    prompts = []
    for question in QUESTIONS:
        ids = hf_default_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


@pytest.mark.slow
def test_default_model_prefill_logits_match_hf(default_model, hf_default_model, chat_prompts, paged_harness):
    worst = 0.0
    for i, prompt in enumerate(chat_prompts):
        (logits,) = paged_harness(default_model.model, block_size=16, num_blocks=16, seed=i).step([("p", prompt)])
        worst = max(worst, (logits - _hf_logits(hf_default_model, prompt)).abs().max().item())
    print(f"\ndefault model, prefill logits: max |ours - HF| = {worst:.2e} over {len(chat_prompts)} prompts")
    assert worst < 1e-3


@pytest.mark.slow
def test_default_model_greedy_matches_hf(default_model, hf_default_model, chat_prompts, paged_harness):
    steps = 20
    prompts = {str(i): p for i, p in enumerate(chat_prompts)}
    ours = paged_harness(default_model.model, block_size=16, num_blocks=32).greedy(prompts, steps)
    eos = default_model.eos_token_ids
    for rid, prompt in prompts.items():
        with torch.no_grad():
            seq = hf_default_model.generate(
                torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=2
            )
        theirs = seq[0, len(prompt) :].tolist()  # HF stops after EOS; our loop runs on, so compare up to it
        assert ours[rid][: len(theirs)] == theirs
        assert len(theirs) == steps or theirs[-1] in eos


@pytest.mark.slow
def test_bf16_linear_weights_stay_close_to_fp32(default_model, hf_default_model, chat_prompts, paged_harness):
    """bf16 weights round every GEMM: no exactness, but the top-1 token should rarely change."""
    bf16 = LlamaForCausalLM(default_model.hf_config, weight_format="bfloat16")
    bf16.load_weights(dict(hf_default_model.state_dict()))
    assert bf16.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert bf16.norm.weight.dtype == torch.float32
    agree, positions, diff = 0, 0, 0.0
    for prompt in chat_prompts:
        (ref,) = paged_harness(default_model.model, block_size=16, num_blocks=16).step([("p", prompt)])
        (got,) = paged_harness(bf16, block_size=16, num_blocks=16).step([("p", prompt)])
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        positions += len(prompt)
        diff = max(diff, (got - ref).abs().max().item() / ref.abs().max().item())
    print(
        f"\nbf16 vs fp32 over {positions} positions: top-1 agreement {agree / positions:.1%}, "
        f"max |logit diff| / max |logit| {diff:.3f}"
    )
    assert agree / positions >= 0.9
    assert diff < 0.1


def test_bf16_lm_head_keeps_the_argmax_of_its_weights():
    """bf16 GEMM outputs tie close logits; the LM head recomputes the near-top ones in fp32."""
    torch.manual_seed(0)
    head = LMHead(64, 4096, False, torch.bfloat16)
    head.weight.data.copy_(torch.randn(4096, 64))
    x = torch.randn(256, 64)
    exact = x @ head.weight.float().T
    plain = torch.nn.functional.linear(x.bfloat16(), head.weight).float()
    assert (plain.argmax(-1) != exact.argmax(-1)).any()  # the problem exists at this size
    got = head(x)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(got.amax(-1), exact.amax(-1), atol=1e-4, rtol=0)
