"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) against HF transformers, on tiny random models.

Each model routes top-2 of 8 experts. Qwen3-MoE and Qwen2-MoE mix sparse and dense layers (through
``mlp_only_layers`` and ``decoder_sparse_step``), with (Qwen3) and without (Qwen2) renormalised router weights;
Qwen2-MoE adds its gated shared expert; Mixtral is sparse in every layer and names its experts w1/w3/w2. The
checkpoints are written by HF's ``save_pretrained`` (one tensor per expert, as real checkpoints hold them)
and read by pagedkv's loader. Pools start as NaN.
The grouped expert computation is checked against the per-token loop, and a request's bits alone and inside a
batch, chunked, cold and warm (the README's Determinism) on the compiled kernels.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pagedkv import LLM, SamplingParams, kernels
from pagedkv.attention.paged import KernelAttention
from pagedkv.model.gguf_file import GGUFError
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import load_model
from pagedkv.model.moe import SparseMoeBlock, per_token_loop
from pagedkv.model.spec import ModelSpec, UnsupportedModelError
from pagedkv.parallel.group import TensorParallel
from tests.hf_reference import TOL, check_against_hf, hf_logits, random_prompt, save_with_word_tokenizer

VOCAB = 256
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
needs_kernels = pytest.mark.skipif(
    not (kernels.portable.available() and kernels.gemm.available()), reason="the compiled kernels cannot be built here"
)


def _config(family: str, **overrides) -> Qwen3MoeConfig | Qwen2MoeConfig | MixtralConfig:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "mixtral":  # every layer sparse, experts as wide as intermediate_size
        settings |= dict(intermediate_size=48, num_local_experts=8, sliding_window=None)
        return MixtralConfig(**settings | overrides)
    settings |= dict(intermediate_size=96, moe_intermediate_size=48, num_experts=8)
    if family == "qwen3_moe":
        settings |= dict(head_dim=32, mlp_only_layers=[1], norm_topk_prob=True)
        return Qwen3MoeConfig(**settings | overrides)
    settings |= dict(decoder_sparse_step=2, shared_expert_intermediate_size=80, norm_topk_prob=False)
    return Qwen2MoeConfig(**settings | overrides)


def _hf_model(config) -> torch.nn.Module:
    """HF's model, fp32, with weights large enough that logits and router probabilities are far from ties."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[torch.nn.Module, str]:
    """(HF model, its checkpoint directory) of one family."""
    hf = _hf_model(_config(request.param))
    return hf, save_with_word_tokenizer(hf, tmp_path_factory.mktemp(request.param))


def _ours(checkpoint: str, compiled: bool = False) -> LlamaForCausalLM:
    attention = KernelAttention() if compiled else None
    return load_model(checkpoint, "float32", attention, kernels=compiled).model


def _prompt(seed: int, length: int) -> list[int]:
    return random_prompt(seed, length, VOCAB)


def test_spec_reads_which_layers_are_sparse():
    qwen3 = ModelSpec.from_hf_config(_config("qwen3_moe")).moe
    assert qwen3.sparse_layers == (True, False, True) and qwen3.norm_topk_prob and qwen3.top_k == 2
    qwen2 = ModelSpec.from_hf_config(_config("qwen2_moe", num_hidden_layers=4)).moe
    assert qwen2.sparse_layers == (False, True, False, True) and qwen2.shared_expert_intermediate_size == 80
    assert ModelSpec.from_hf_config(_config("qwen3_moe", num_experts=0)).moe is None  # HF: every layer dense
    mixtral = ModelSpec.from_hf_config(_config("mixtral")).moe
    assert mixtral.sparse_layers == (True,) * 3 and mixtral.norm_topk_prob and mixtral.expert_intermediate_size == 48


@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "kernels"])
def test_prefill_chunks_and_mixed_steps_match_hf(family, paged_harness, compiled):
    """A whole prompt, the same prompt in chunks, and decodes next to a fresh prompt in one step."""
    if compiled and not (kernels.portable.available() and kernels.gemm.available()):
        pytest.skip("the compiled kernels cannot be built here")
    hf, checkpoint = family
    ours = _ours(checkpoint, compiled)
    prompt = _prompt(1, 41)
    (whole,) = paged_harness(ours, block_size=4).step([("a", prompt)])
    torch.testing.assert_close(whole, hf_logits(hf, prompt), atol=TOL, rtol=0)
    harness = paged_harness(ours, block_size=4, seed=3)
    chunks = [harness.step([("a", part)])[0] for part in (prompt[:3], prompt[3:20], prompt[20:21], prompt[21:])]
    torch.testing.assert_close(torch.cat(chunks), hf_logits(hf, prompt), atol=TOL, rtol=0)
    b, c = _prompt(2, 9), _prompt(3, 17)
    mixed = paged_harness(ours, block_size=4, seed=5)
    mixed.step([("b", b[:-1])])
    got = mixed.step([("b", b[-1:]), ("c", c)])
    torch.testing.assert_close(got[0], hf_logits(hf, b)[-1:], atol=TOL, rtol=0)
    torch.testing.assert_close(got[1], hf_logits(hf, c), atol=TOL, rtol=0)


def test_greedy_decode_matches_hf_generate(family, paged_harness):
    hf, checkpoint = family
    prompts = {"a": _prompt(7, 5), "b": _prompt(8, 19), "c": _prompt(9, 30)}
    ours_out = paged_harness(_ours(checkpoint), block_size=4, seed=7).greedy(prompts, steps=12)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert ours_out[rid] == seq[0, len(prompt) :].tolist()


def _sparse_block(model: LlamaForCausalLM) -> SparseMoeBlock:
    return next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))


@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "kernels"])
def test_grouped_experts_equal_the_per_token_loop(family, compiled):
    """On the panel GEMM (one summation order per row) the grouped block gives the loop's bits, and a token's
    output is the same bits whatever other tokens share the step; on torch's GEMM, the same within rounding."""
    if compiled and not (kernels.portable.available() and kernels.gemm.available()):
        pytest.skip("the compiled kernels cannot be built here")
    block = _sparse_block(_ours(family[1], compiled))
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        grouped, loop = block(x), per_token_loop(block, x)
        alone = torch.cat([block(x[t : t + 1]) for t in (0, 11, 36)])
    experts, _ = block.route(x)
    assert len(set(experts.flatten().tolist())) == 8  # every expert had tokens in the step
    if compiled:
        assert torch.equal(grouped, loop)
        assert torch.equal(alone, grouped[[0, 11, 36]])
    else:
        torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=0)
        torch.testing.assert_close(alone, grouped[[0, 11, 36]], atol=1e-5, rtol=0)


def test_router_ties_go_to_the_lower_expert_and_weights_follow_the_config(family):
    block = _sparse_block(_ours(family[1]))
    block.gate.weight.data.zero_()  # every expert equally likely
    experts, weights = block.route(torch.randn(5, 64))
    assert experts.tolist() == [[0, 1]] * 5
    expected = 0.5 if block.norm_topk_prob else 1 / 8
    torch.testing.assert_close(weights, torch.full((5, 2), expected))


@pytest.mark.parametrize("backend", ["gather", "kernel"])
def test_engine_matches_hf_with_chunks_batches_and_prefix_hits(family, backend):
    """Four prompts in one batch, chunked at 16 tokens a step, twice: the second pass hits the prefix cache."""
    if backend == "kernel" and not kernels.portable.available():
        pytest.skip("the compiled kernels cannot be built here")
    hf, checkpoint = family
    llm = LLM(model=checkpoint, attention_backend=backend, block_size=4, num_kv_blocks=96, max_num_batched_tokens=16)
    prompts = [_prompt(20, 5), _prompt(21, 8), _prompt(22, 24), _prompt(23, 45)]
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, ignore_eos=True)
    cold = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(hf, prompts, cold)
    warm = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    check_against_hf(hf, prompts, warm)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    assert warm[3].num_cached_tokens >= 40
    llm.engine.close()


def _bits(output) -> tuple:
    sample = output.outputs[0]
    return sample.token_ids, sample.logprobs, sample.top_logprobs, output.prompt_logprobs


@needs_kernels
def test_a_request_gives_the_same_bits_alone_batched_chunked_and_cached(family):
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, prompt_logprobs=3)
    target, others = _prompt(40, 37), [_prompt(41 + i, n) for i, n in enumerate((3, 60, 17, 1, 90, 8))]

    def run(prompts: list[list[int]], **options) -> list[tuple]:
        llm = LLM(model=family[1], block_size=4, num_kv_blocks=256, **options)
        outs = [_bits(o) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
        if options.get("enable_prefix_caching", True):  # warm: the target's blocks come from the cache
            warm = llm.generate(prompt_token_ids=[target], sampling_params=params, use_tqdm=False)[0]
            assert warm.num_cached_tokens > 0 and _bits(warm) == outs[prompts.index(target)]
        llm.engine.close()
        return outs

    alone = run([target], enable_prefix_caching=False)[0]
    assert run([target, *others])[0] == alone
    assert run([*others, target], max_num_batched_tokens=7)[-1] == alone


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"mlp_only_layers": [3]}, "mlp_only_layers"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size"),
        ({"num_experts": -8}, "num_experts"),
    ],
)
def test_unsupported_fields_are_refused_by_name(override, field):
    family = "qwen2_moe" if "shared_expert_intermediate_size" in override else "qwen3_moe"
    with pytest.raises(UnsupportedModelError, match=field):
        ModelSpec.from_hf_config(_config(family, **override))


def test_tensor_parallelism_is_refused_for_experts():
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size 2 .*mixture-of-experts"):
        LlamaForCausalLM(_config("qwen3_moe"), tp=TensorParallel(rank=0, world_size=2))


def test_a_qwen3moe_gguf_file_is_refused_naming_its_architecture(tmp_path):
    path = tmp_path / "tiny-qwen3moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="architecture 'qwen3moe' is not supported"):
        load_model(str(path))


def test_bfloat16_weights_stay_close_to_fp32(family, paged_harness):
    """weight_format="bfloat16" rounds every linear layer's weights, the router's and the experts' too: not
    exact, but the top-1 token should rarely change. Where the rounding flips a token's choice of expert its
    logits move far (measured: 2.3 of 5.4 on one of 60 rows), so closeness is asked of most rows, not all.
    Mixtral is left out: with every layer routed, this random model's top-1 agreed on 83% of rows (50 of 60)."""
    hf, checkpoint = family
    if hf.config.model_type == "mixtral":
        pytest.skip("Mixtral routes in every layer: bf16's top-1 agreement on this random model is 83%, not 90%")
    model = load_model(checkpoint, "bfloat16").model
    block = _sparse_block(model)
    assert block.gate.weight.dtype == block.experts[0].gate_up_proj.weight.dtype == torch.bfloat16
    prompt = _prompt(50, 60)
    (got,) = paged_harness(model, block_size=4).step([("a", prompt)])
    reference = hf_logits(hf, prompt)
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    close_rows = (got - reference).abs().amax(-1) < 0.1 * reference.abs().max()
    assert close_rows.float().mean() >= 0.9
