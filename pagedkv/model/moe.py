"""The sparse mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral), computed per expert, not per token.

A step holds T tokens; each picks ``top_k`` of ``num_experts`` SwiGLU experts. Looping over tokens would
read an expert's weights once for every token that chose it -- at decode sizes the weights *are* the cost.
Instead the T * top_k (token, expert) assignments are sorted by expert once, and every expert that has
tokens runs one GEMM over its gathered rows: each expert's weights are read once a step
(``benchmarks/moe_layer.py`` measures the difference).

Batch invariance (README: Determinism) holds because nothing a token computes depends on its neighbours:

- the router is a linear layer like any other (on the panel GEMM: one fixed summation order per row), and
  softmax, the choice of experts and the renormalisation are per row. Ties between equal probabilities go to
  the lower expert id (a stable descending sort, not ``topk``, whose tie order is unspecified);
- an expert's GEMM sums each row in its own fixed order, however many rows it was given;
- a token's expert outputs are added in ascending expert id, starting from its first -- the order HF's loop
  over experts adds them in -- whichever tokens shared the step.

With a shared expert (Qwen2-MoE), ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` is added last, as HF does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.model.layers import GatedMLP, Linear
from pagedkv.model.moe_spec import MoESpec
from pagedkv.model.spec import UnsupportedModelError
from pagedkv.parallel.group import TensorParallel

WeightLoader = Callable[[Tensor], None]


class SparseMoeBlock(nn.Module):
    """Router + ``num_experts`` SwiGLU experts (+ an optional gated shared expert); HF's parameter names."""

    def __init__(self, hidden: int, moe: MoESpec, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        if tp.world_size > 1:
            raise UnsupportedModelError(
                f"tensor_parallel_size {tp.world_size} is not supported for mixture-of-experts models "
                "(their experts are not sharded): use tensor_parallel_size 1"
            )
        self.top_k = moe.top_k
        self.expert_parts = moe.expert_parts
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = Linear(hidden, moe.num_experts, False, dtype)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, moe.expert_intermediate_size, False, dtype, tp) for _ in range(moe.num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden, moe.shared_expert_intermediate_size, False, dtype, tp)
            self.shared_expert_gate = Linear(hidden, 1, False, dtype)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's chosen experts in ascending id ``[T, top_k]`` and their fp32 weights ``[T, top_k]``.

        HF's router: softmax over every expert, the ``top_k`` largest probabilities, renormalised to sum to 1
        when ``norm_topk_prob``. The weights are computed in the order of the probabilities, as HF does, and
        only then ordered by expert id (the order the outputs are summed in)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, experts = probs.sort(dim=-1, descending=True, stable=True)  # ties: the lower expert id first
        top, experts = top[:, : self.top_k], experts[:, : self.top_k]
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        experts, order = experts.sort(dim=-1)
        return experts, top.gather(1, order)

    def forward(self, x: Tensor) -> Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``: one GEMM per expert that has tokens (see the module docstring)."""
        tokens = x.shape[0]
        experts, weights = self.route(x)
        assignments = experts.flatten()  # assignment t * top_k + j: token t's j-th expert by id
        by_expert = assignments.argsort(stable=True)  # grouped by expert, tokens ascending within each
        counts = torch.bincount(assignments, minlength=len(self.experts)).tolist()
        token_of = by_expert // self.top_k
        flat_weights = weights.flatten()
        outputs = x.new_empty(tokens * self.top_k, x.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = by_expert[start : start + count]
            y = self.experts[expert](x.index_select(0, token_of[start : start + count]))
            outputs.index_copy_(0, rows, y.mul_(flat_weights.index_select(0, rows).unsqueeze(1)))
            start += count
        per_token = outputs.view(tokens, self.top_k, -1)
        out = per_token[:, 0].clone()
        for j in range(1, self.top_k):
            out += per_token[:, j]
        return self._add_shared_expert(x, out)

    def _add_shared_expert(self, x: Tensor, out: Tensor) -> Tensor:
        if self.shared_expert is None:
            return out
        return out.add_(_sigmoid_per_row(self.shared_expert_gate(x)) * self.shared_expert(x))

    def weight_targets(self, prefix: str) -> dict[str, WeightLoader]:
        """HF checkpoint name (``prefix``: the layer's block, ``...mlp.``) -> loader into this block's parameters.

        Experts are named as the family's checkpoints name them (``MoESpec.expert_parts``); the shared expert
        (Qwen2-MoE) as Qwen's."""
        targets = {f"{prefix}gate.weight": partial(self.gate.load_part, "weight", 0)}
        mlps = [(f"{prefix}experts.{i}.", expert, self.expert_parts) for i, expert in enumerate(self.experts)]
        if self.shared_expert is not None:
            mlps.append((f"{prefix}shared_expert.", self.shared_expert, ("gate_proj", "up_proj", "down_proj")))
            targets[f"{prefix}shared_expert_gate.weight"] = partial(self.shared_expert_gate.load_part, "weight", 0)
        for name, mlp, (gate, up, down) in mlps:
            targets[f"{name}{gate}.weight"] = partial(mlp.gate_up_proj.load_part, "weight", 0)
            targets[f"{name}{up}.weight"] = partial(mlp.gate_up_proj.load_part, "weight", mlp.intermediate)
            targets[f"{name}{down}.weight"] = partial(mlp.down_proj.load_part, "weight", 0)
        return targets


def _sigmoid_per_row(gate: Tensor) -> Tensor:
    """``sigmoid(gate)`` for ``gate [T, 1]``, each value's bits independent of ``T``.

    torch computes most of a tensor in SIMD vectors and the last ``len % (2 * lanes)`` values with the scalar
    formula, which rounds differently (measured: 6e-8 apart), so a token's gate would depend on how many
    tokens share the step. Each value is placed at the start of its own 64-float row, so every value is
    computed in a full vector, whatever ``T`` (64 is a multiple of twice the widest vector, 16 floats)."""
    padded = gate.new_zeros(gate.shape[0], 64)
    padded[:, :1] = gate
    return torch.sigmoid(padded)[:, :1]


def per_token_loop(block: SparseMoeBlock, x: Tensor) -> Tensor:
    """The reference the grouped forward is tested and measured against: every token runs its experts one
    by one (each expert's weights read once per token that chose it), summed in the same order."""
    experts, weights = block.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for expert, weight in zip(experts[t].tolist(), weights[t], strict=True):
            out[t] += block.experts[expert](x[t : t + 1])[0] * weight
    return block._add_shared_expert(x, out)
