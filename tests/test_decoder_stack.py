"""The compiled decoder stack (``csrc/decoder_stack.cpp``) against the model's own modules, which it replaces in
a step: the same hidden states and the same KV pool, bit for bit, on mixed steps (prefill chunks, decodes,
drafts), with fp32 panels and with exact Q4_1 codes; and the configurations it does not cover run the modules."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedkv import kernels
from pagedkv.attention.paged import KernelAttention, TorchAttention
from pagedkv.model.decoder_stack import DecoderStack, stack_for
from pagedkv.model.llama import LlamaForCausalLM
from tests.test_panel import q4_1_weight

pytestmark = pytest.mark.skipif(
    not (kernels.portable.available() and kernels.gemm.available()), reason="the compiled ops could not be built here"
)

BLOCK = 4
CONFIG = dict(
    vocab_size=96,
    hidden_size=256,  # 4 heads of 64, the attention kernel's specialised size; K a multiple of the Q4_1 group
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
# Two steps of three requests (block tables, new tokens, context after the step): whole prompts first, then
# a decode, a decode with two drafts, and a new prompt's first chunk -- in that order, not decodes first.
STEPS = [
    ([[1, 2], [3, 4, 5, 6]], [7, 13], [7, 13]),
    ([[3, 4, 5, 6], [7, 8], [1, 2]], [3, 5, 1], [16, 5, 8]),
]


def model(weights: str, attention=None, **config) -> LlamaForCausalLM:
    m = LlamaForCausalLM(LlamaConfig(**(CONFIG | config)), attention=attention or KernelAttention())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif weights == "q4" and p.dim() == 2 and "layers" in name:
                p.copy_(q4_1_weight(*p.shape, seed=int(torch.randint(1 << 30, (1,), generator=g)))[0])
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    m.use_kernels(quantized=True)
    if attention is None and "attention_bias" not in config:
        layer = m.layers[0]
        assert layer.self_attn.qkv_proj.panel.format == layer.mlp.down_proj.panel.format == weights
    return m


def new_pools(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (16, BLOCK, CONFIG["num_key_value_heads"], 64)
    return [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(CONFIG["num_hidden_layers"])
    ]


def run_step(m: LlamaForCausalLM, step: int, pools: list, g: torch.Generator) -> torch.Tensor:
    """Every row's final hidden state of ``STEPS[step]``."""
    tables, query_lens, seq_lens = STEPS[step]
    meta = m.attention.build_metadata(tables, query_lens, seq_lens, BLOCK)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
    ids = torch.randint(CONFIG["vocab_size"], (len(positions),), generator=g)
    return m.hidden_states(ids, positions, meta, pools, torch.arange(len(positions)))


def run_steps(
    m: LlamaForCausalLM, fused: bool, kv_dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every row's final hidden state of each step, and the pools (of ``kv_dtype``) after them."""
    m.fused_layers = fused
    pools, g = new_pools(kv_dtype), torch.Generator().manual_seed(1)
    return [run_step(m, i, pools, g) for i in range(len(STEPS))], pools


@pytest.mark.parametrize("weights", ["fp32", "q4"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32-kv", "fp16-kv"])
def test_the_stack_computes_the_modules_bits(weights: str, threads: int, kv_dtype: torch.dtype) -> None:
    m = model(weights)
    calls = []
    for layer in m.layers:
        layer.register_forward_hook(lambda *_: calls.append(1))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused_hidden, fused_pools = run_steps(m, fused=True, kv_dtype=kv_dtype)
        assert isinstance(m._stack, DecoderStack) and calls == []  # the stack ran, no layer module did
        hidden, pools = run_steps(m, fused=False, kv_dtype=kv_dtype)
        assert len(calls) == 2 * CONFIG["num_hidden_layers"]
    finally:
        torch.set_num_threads(previous)
    for got, expected in zip(fused_hidden, hidden, strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(fused_pools, pools, strict=True):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert pools[0][0][1:9].abs().sum() > 0  # every written block holds K


def test_configurations_it_does_not_cover_run_the_modules() -> None:
    assert stack_for(model("fp32", attention=TorchAttention())) is None
    assert stack_for(model("fp32", attention_bias=True)) is None  # q/k/v and o biases
    plain = LlamaForCausalLM(LlamaConfig(**CONFIG), attention=KernelAttention())  # never packed: torch's GEMM
    assert stack_for(plain) is None
    m = model("fp32", attention=TorchAttention())
    hidden, _ = run_steps(m, fused=True)
    assert m._stack is False and all(torch.isfinite(h).all() for h in hidden)


def test_the_stack_refuses_pools_that_do_not_match_its_layers() -> None:
    stack = stack_for(model("fp32"))
    pools = [(torch.zeros(16, BLOCK, 2, 64), torch.zeros(16, BLOCK, 2, 64))]
    with pytest.raises(ValueError, match="one k and one v pool per layer"):
        stack._stack.bind_pools([k for k, _ in pools], [v for _, v in pools])


def test_pools_replaced_between_steps_are_the_ones_written() -> None:
    """The stack binds the pools once, and again whenever the caller's pairs are other tensors, even in the
    same list: a stale binding would write the step's K/V where nobody reads them."""
    m = model("fp32")
    pools, g = new_pools(), torch.Generator().manual_seed(1)
    run_step(m, 0, pools, g)
    pools[0] = (torch.zeros_like(pools[0][0]), torch.zeros_like(pools[0][1]))  # the same list, a new pair
    run_step(m, 0, pools, torch.Generator().manual_seed(1))
    assert pools[0][0].abs().sum() > 0 and pools[0][1].abs().sum() > 0
