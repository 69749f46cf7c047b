"""The compiled decoder stack (``csrc/decoder_stack.cpp``) against the model's own modules, which it replaces in
a step: the same hidden states and the same KV pool, bit for bit, on mixed steps (prefill chunks, decodes,
drafts), with fp32 panels, quantised ones, fused layers whose parts are in different formats (a Q4_K_M file's),
biases on every linear, Qwen3's q/k norm, Gemma 3's layers and Phi-4-mini's partial rotary; and the
configurations it does not cover run the modules."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config

from pagedkv import kernels
from pagedkv.attention.paged import KernelAttention, TorchAttention
from pagedkv.model import panel
from pagedkv.model.decoder_stack import DecoderStack, stack_for
from pagedkv.model.layers import Linear
from pagedkv.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(
    not (kernels.portable.available() and kernels.gemm.available()), reason="the compiled ops could not be built here"
)

BLOCK = 4
HEAD_DIM = 64  # the attention kernel's specialised size
CONFIG = dict(
    vocab_size=96,
    hidden_size=256,  # 4 heads of 64; K a multiple of every quantised format's group
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
Q_ROWS = CONFIG["num_attention_heads"] * HEAD_DIM
# The models the stack runs: how each layer's linears are packed, and the config. "mixed" is what a Q4_K_M
# file gives: q (and k) rows Q4_K, the rest Q6_K; here q4 | q8g16 in q|k|v, gate and up apart too.
KINDS = {
    "fp32": (None, LlamaConfig(**CONFIG)),
    "q4": ("q4", LlamaConfig(**CONFIG)),
    "mixed": ("mixed", LlamaConfig(**CONFIG)),
    "mixed-biases": ("mixed", LlamaConfig(**CONFIG, attention_bias=True, mlp_bias=True)),  # q/k/v/o, gate|up, down
    "qwen3-mixed": ("mixed", Qwen3Config(**CONFIG, head_dim=HEAD_DIM)),  # the q/k norm
    # four norms a layer, GeLU-tanh, q/k norm, a 5-token window on the first and last layers with their own
    # RoPE base (the steps' contexts reach 16), a softmax scale not head_dim ** -0.5
    "gemma3-mixed": (
        "mixed",
        Gemma3TextConfig(
            **CONFIG,
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=40,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
        ),
    ),
    # Phi-4-mini: RoPE on the first 3/4 of each head only (48 of 64 dimensions), the rest passed through
    "phi4-partial-rotary": ("mixed", Phi3Config(**CONFIG, partial_rotary_factor=0.75, pad_token_id=0)),
}
# Two steps of three requests (block tables, new tokens, context after the step): whole prompts first, then
# a decode, a decode with two drafts, and a new prompt's first chunk -- in that order, not decodes first.
STEPS = [
    ([[1, 2], [3, 4, 5, 6]], [7, 13], [7, 13]),
    ([[3, 4, 5, 6], [7, 8], [1, 2]], [3, 5, 1], [16, 5, 8]),
]


def coded(fmt: str, n: int, k: int, g: torch.Generator) -> panel.PanelWeight:
    """A weight ``[n, k]`` of random codes in ``fmt``, as a GGUF file's would be packed, with model-sized scales."""
    bits, group, has_min = panel.CODED[fmt]
    low, high = (0, 15) if bits == 4 else (-128, 127)
    q = torch.randint(low, high + 1, (n, k), generator=g)
    d = (torch.rand(n, k // group, generator=g) * (0.02 if bits == 4 else 0.002)).half().float()
    m = (-torch.rand(n, k // group, generator=g) * 0.15).half().float() if has_min else None
    return panel.pack_codes(q, d, m, fmt)


def pack_parts(linear: Linear, parts: list[tuple[int, str]], g: torch.Generator) -> None:
    """Give ``linear`` panels of random codes, ``parts`` being (rows, format) in row order, as loading a GGUF
    file does; the fp32 weight goes."""
    out_features, in_features = linear.weight.shape
    assert sum(rows for rows, _ in parts) == out_features
    linear.panels = tuple(coded(fmt, rows, in_features, g) for rows, fmt in parts)
    linear.release_weight()


def quantise(m: LlamaForCausalLM, layout: str, g: torch.Generator) -> None:
    """Every layer's linears in ``layout``: "q4" (one part each) or "mixed" (q|k|v and gate|up in two parts of
    two formats, o and down in one each)."""
    hidden = CONFIG["hidden_size"]
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_rows, gate_rows = attn.qkv_proj.weight.shape[0], mlp.intermediate
        if layout == "q4":
            parts = [[(qkv_rows, "q4")], [(hidden, "q4")], [(2 * gate_rows, "q4")], [(hidden, "q4")]]
        else:
            parts = [
                [(Q_ROWS, "q4"), (qkv_rows - Q_ROWS, "q8g16")],
                [(hidden, "q8g16")],
                [(gate_rows, "q4"), (gate_rows, "q8")],
                [(hidden, "q4")],
            ]
        for linear, rows in zip((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj), parts, strict=True):
            pack_parts(linear, rows, g)


def model(kind: str, attention=None) -> LlamaForCausalLM:
    """A ``KINDS[kind]`` model with random weights (norm weights near 1), on the compiled kernels."""
    layout, config = KINDS[kind]
    m = LlamaForCausalLM(config, attention=attention or KernelAttention())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    if layout is not None:
        quantise(m, layout, g)
    m.use_kernels()  # packs what is still fp32 (the embedding's tied or untied head) and compiles the rest
    return m


def new_pools(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (16, BLOCK, CONFIG["num_key_value_heads"], HEAD_DIM)
    return [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(CONFIG["num_hidden_layers"])
    ]


def run_step(m: LlamaForCausalLM, step: int, pools: list, g: torch.Generator) -> torch.Tensor:
    """Every row's final hidden state of ``STEPS[step]``."""
    tables, query_lens, seq_lens = STEPS[step]
    meta = m.attention.build_metadata(tables, query_lens, seq_lens, BLOCK)
    window_meta = None
    if any(m.spec.layer_windows):  # the windowed layers' own block tables, as the hybrid KV manager gives them
        window_tables = [[15 - block for block in table] for table in tables]
        window_meta = m.attention.build_metadata(window_tables, query_lens, seq_lens, BLOCK)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
    ids = torch.randint(CONFIG["vocab_size"], (len(positions),), generator=g)
    return m.hidden_states(ids, positions, meta, pools, torch.arange(len(positions)), window_meta)


def run_steps(
    m: LlamaForCausalLM, fused: bool, kv_dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every row's final hidden state of each step, and the pools (of ``kv_dtype``) after them."""
    m.fused_layers = fused
    pools, g = new_pools(kv_dtype), torch.Generator().manual_seed(1)
    return [run_step(m, i, pools, g) for i in range(len(STEPS))], pools


def test_the_models_are_what_their_kinds_say() -> None:
    """The layouts and configs reach the layers: parts in their formats, biases, the q/k norm."""
    layer = model("fp32").layers[0]
    assert [p.format for p in layer.self_attn.qkv_proj.panels] == ["fp32"] and layer.self_attn.qkv_proj.bias is None
    layer = model("q4").layers[0]
    assert [p.format for p in layer.mlp.down_proj.panels] == ["q4"]
    layer = model("mixed-biases").layers[0]
    assert [p.format for p in layer.self_attn.qkv_proj.panels] == ["q4", "q8g16"]
    assert [p.format for p in layer.mlp.gate_up_proj.panels] == ["q4", "q8"]
    assert all(m.bias is not None for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert model("qwen3-mixed").layers[0].self_attn.qk_norm_weight is not None
    gemma = model("gemma3-mixed")
    assert [layer.self_attn.window for layer in gemma.layers] == [5, 0, 5]
    assert [layer.rope for layer in gemma.layers] == [1, 0, 1]
    assert all(layer.sandwich and layer.mlp.activation == "gelu_tanh" for layer in gemma.layers)
    assert model("phi4-partial-rotary").spec.rotary_dim == 48


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32-kv", "fp16-kv"])
def test_the_stack_computes_the_modules_bits(kind: str, threads: int, kv_dtype: torch.dtype) -> None:
    m = model(kind)
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
    assert pools[1][0][1:9].abs().sum() > 0  # every written block holds K (layer 1: full attention, as all Llama's)
    if kind.startswith("gemma3"):  # the windowed layers wrote their own tables' blocks only
        assert pools[0][0][7:15].abs().sum() > 0 and pools[0][0][1:7].abs().sum() == 0


def test_configurations_it_does_not_cover_run_the_modules() -> None:
    assert stack_for(model("fp32", attention=TorchAttention())) is None
    plain = LlamaForCausalLM(LlamaConfig(**CONFIG), attention=KernelAttention())  # never packed: torch's GEMM
    assert stack_for(plain) is None
    m = model("mixed-biases", attention=TorchAttention())
    hidden, _ = run_steps(m, fused=True)
    assert m._stack is False and all(torch.isfinite(h).all() for h in hidden)


# add_layer's Gemma arguments for a Llama layer: no MLP norms, no window, the first RoPE table, SiLU
PLAIN = ([], 0, 0, False)


def test_the_stack_refuses_layers_and_pools_that_do_not_fit() -> None:
    stack = stack_for(model("fp32"))._stack
    norm, part = torch.ones(256), panel.pack_fp32(torch.zeros(32, 256))
    with pytest.raises(ValueError, match="part counts and biases of 4 linears"):
        stack.add_layer(norm, norm, None, [part.packed] * 3, [32, 256, 0] * 3, [1, 1, 1], [None] * 3, *PLAIN)
    with pytest.raises(ValueError, match="one part or more"):
        stack.add_layer(norm, norm, None, [part.packed] * 4, [32, 256, 0] * 4, [1, 1, 1, 2], [None] * 4, *PLAIN)
    with pytest.raises(ValueError, match="more parts than the part counts say"):
        stack.add_layer(norm, norm, None, [part.packed] * 5, [32, 256, 0] * 5, [1, 1, 1, 1], [None] * 4, *PLAIN)
    with pytest.raises(ValueError, match="both of Gemma's MLP norms"):
        stack.add_layer(
            norm, norm, None, [part.packed] * 4, [32, 256, 0] * 4, [1, 1, 1, 1], [None] * 4, [norm], 0, 0, True
        )
    with pytest.raises(ValueError, match="rotary_dim must be even and in"):
        torch.classes.pagedkv.DecoderStack(4, 2, HEAD_DIM, HEAD_DIM + 2, 1e-6, 0.125)
    pools = [(torch.zeros(16, BLOCK, 2, HEAD_DIM), torch.zeros(16, BLOCK, 2, HEAD_DIM))]
    with pytest.raises(ValueError, match="one k and one v pool per layer"):
        stack.bind_pools([k for k, _ in pools], [v for _, v in pools])


def test_pools_replaced_between_steps_are_the_ones_written() -> None:
    """The stack binds the pools once, and again whenever the caller's pairs are other tensors, even in the
    same list: a stale binding would write the step's K/V where nobody reads them."""
    m = model("fp32")
    pools, g = new_pools(), torch.Generator().manual_seed(1)
    run_step(m, 0, pools, g)
    pools[0] = (torch.zeros_like(pools[0][0]), torch.zeros_like(pools[0][1]))  # the same list, a new pair
    run_step(m, 0, pools, torch.Generator().manual_seed(1))
    assert pools[0][0].abs().sum() > 0 and pools[0][1].abs().sum() > 0
