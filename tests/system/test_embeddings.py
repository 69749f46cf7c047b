"""Embeddings (``SamplingParams.pooling``, ``LLM.embed``) on the default model, against HF transformers' own
final hidden states of the same file, and their independence from the cache, chunking, batching and
preemption."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.errors import InvalidParameter

pytestmark = pytest.mark.slow

TEXTS = [
    "The lighthouse keeper counted forty-one ships before noon and wrote each name in the ledger.",
    "Fog came in early, so the lamp was lit an hour before sunset.",
    "Paris",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256, max_model_len=1024)


def _hf_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    """HF's last hidden states (after the final norm, what its LM head reads), pooled and normalised."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].double()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return vector / vector.norm()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_hf_hidden_states(llm, hf_default_model, pooling):
    outputs = llm.embed(TEXTS, pooling=pooling, use_tqdm=False)
    for text, out in zip(TEXTS, outputs, strict=True):
        ids = llm.engine.encode(text)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == [] and out.error is None
        ours = torch.tensor(out.embedding, dtype=torch.float64)
        assert ours.shape == (hf_default_model.config.hidden_size,)
        assert abs(ours.norm().item() - 1.0) < 1e-6
        assert (ours - _hf_embedding(hf_default_model, ids, pooling)).abs().max().item() <= 1e-5


def test_last_and_mean_differ_and_texts_differ(llm):
    last, mean = (llm.embed(TEXTS[:2], pooling=p, use_tqdm=False) for p in ("last", "mean"))
    assert last[0].embedding != mean[0].embedding
    assert last[0].embedding != last[1].embedding


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_same_bits_cold_warm_chunked_and_batched(llm, pooling):
    text = " ".join(TEXTS) * 4
    llm.reset_prefix_cache()
    cold = llm.embed(text, pooling=pooling, use_tqdm=False)[0]
    warm = llm.embed(text, pooling=pooling, use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0
    assert warm.embedding == cold.embedding
    batched = llm.embed([TEXTS[0], text, TEXTS[1]], pooling=pooling, use_tqdm=False)[1]
    assert batched.embedding == cold.embedding
    chunked = LLM(num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=13, enable_prefix_caching=False)
    assert chunked.embed(text, pooling=pooling, use_tqdm=False)[0].embedding == cold.embedding


def test_embedding_beside_generation_changes_no_token(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate(TEXTS[0], greedy, use_tqdm=False)[0]
    mixed = llm.generate([TEXTS[0], TEXTS[1]], [greedy, SamplingParams(max_tokens=0, pooling="mean")], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[1].embedding == llm.embed(TEXTS[1], pooling="mean", use_tqdm=False)[0].embedding


def test_a_preempted_embedding_is_the_same_bits(llm):
    # generations that outgrow a tight pool preempt the embedding mid-prefill: its rows are computed again
    ids = llm.engine.encode(" ".join(TEXTS) * 12)
    expected = llm.embed(prompt_token_ids=[ids], pooling="mean", use_tqdm=False)[0].embedding
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    tight = LLM(num_kv_blocks=-(-len(ids) // 16) + 3, max_model_len=1024, max_num_batched_tokens=32)
    others = [llm.engine.encode(f"Story {i}: " + TEXTS[0][: 40 + 9 * i]) for i in range(3)]
    params = [long] * 3 + [SamplingParams(max_tokens=0, pooling="mean")]
    outs = tight.generate(prompt_token_ids=[*others, ids], sampling_params=params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    assert outs[-1].embedding == expected
    assert tight.stats()["kv_blocks_free"] == tight.stats()["kv_blocks_total"]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pooling="max", max_tokens=0),
        dict(pooling="last", max_tokens=4),
        dict(pooling="last", max_tokens=0, n=2),
        dict(pooling="mean", max_tokens=0, prompt_logprobs=1),
    ],
)
def test_bad_pooling_settings_are_refused_by_name(kwargs):
    with pytest.raises(InvalidParameter, match="pooling"):
        SamplingParams(**kwargs)
