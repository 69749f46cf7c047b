"""ModelRunner takes the scheduler's requests in any order, and each request gets the same logits either way,
on either attention backend."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedkv import kernels
from pagedkv.attention.paged import KernelAttention, TorchAttention
from pagedkv.engine.request import Request
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.scheduler import ScheduledRequest, SchedulerOutput
from pagedkv.kv.manager import KVCacheManager
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.sampling_params import SamplingParams

CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def runner(attention) -> ModelRunner:
    model = LlamaForCausalLM(CONFIG, attention=attention)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return ModelRunner(model, KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False))


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, request_id, 0, list(tokens), len(tokens), SamplingParams())


def run(runner: ModelRunner, scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
    """One step; each request's logits rows, found through the ``sampled`` list the runner returns."""
    for s in scheduled:
        assert runner.kv.allocate(s.request.request_id, s.request.num_computed_tokens + s.num_new_tokens)
    result = runner.execute(SchedulerOutput(scheduled))
    rows = result.logits.split([n for _, n in result.sampled])
    return {scheduled[i].request.request_id: r for (i, _), r in zip(result.sampled, rows, strict=True)}


@pytest.mark.parametrize("backend", [TorchAttention, KernelAttention])
def test_any_order_gives_the_same_logits(backend):
    if backend is KernelAttention and not kernels.portable.available():
        pytest.skip("the C++ attention kernel cannot be built here")
    results = []
    for order in ("decodes first", "prefills first"):
        r = runner(backend())
        decoding, prefilling = request("d", [1, 2, 3, 4, 5, 6]), request("p", [7, 8, 9, 10, 11, 12, 13])
        run(r, [ScheduledRequest(decoding, 6)])
        decoding.num_computed_tokens = 6
        decoding.token_ids.append(14)
        step = [ScheduledRequest(decoding, 1), ScheduledRequest(prefilling, 7)]
        results.append(run(r, step if order == "decodes first" else step[::-1]))
    assert results[0].keys() == results[1].keys() == {"d", "p"}
    for request_id, logits in results[0].items():
        torch.testing.assert_close(results[1][request_id], logits, atol=1e-5, rtol=0)
