"""The model's building blocks: a dtype-aware linear layer, RMSNorm and the gated MLP (SwiGLU or GeGLU).

Only linear layers (and the embedding table, which a tied LM head shares) may hold bf16 weights: that is
where bf16 pays on CPUs with native bf16 GEMMs. Everything between GEMMs -- the residual stream, norms,
softmax, logits, and the KV pool unless kv_cache_dtype="float16" is asked for -- stays fp32, so a bf16 model
differs from the fp32 one only by weight rounding and bf16 GEMM outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv import kernel_ops
from pagedkv.model import gguf_blocks, gguf_weights, int8_linear, panel
from pagedkv.model.gguf_file import GGUFTensor
from pagedkv.model.panel import PanelWeight
from pagedkv.parallel.group import TensorParallel

# The weight formats (``config.WEIGHT_FORMATS``, the names) and the dtype each keeps its linear weights in. "gguf":
# fp32 math on a GGUF file's own codes, packed from the file for the panel GEMM (see Linear.load_part);
# "gguf-int8": llama.cpp's int8-activation arithmetic on the file's blocks, opt-in (model/int8_linear.py).
WEIGHT_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "gguf": torch.float32,
    int8_linear.WEIGHT_FORMAT: torch.float32,
}
# relative distance below a row's top bf16 logit within which the order is unreliable: two roundings of
# 2**-8 each, plus the bf16 rounding of the GEMM's input, with room to spare
_BF16_TIE_MARGIN = 2.0**-6
# For a batch of 8..512 rows, MKL ran ``W @ x^T`` (returned as a transposed view) 1.3-1.8x faster than
# ``x @ W^T`` at this model's shapes on the 2-core AVX2 dev machine (LM head, 32 rows: 25 vs 39 ms);
# outside that range F.linear was as fast or faster. Re-measure with benchmarks/linear_layout.py on a new machine.
_TRANSPOSED_GEMM_ROWS = (8, 512)


def empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, frozen parameter: load_weights overwrites every weight, and random init of the
    vocabulary-sized matrices would cost seconds."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b`` with W (and b) in ``dtype``; takes and returns fp32 activations.

    Fused projections (q|k|v, gate|up) are one Linear whose rows are the concatenated weights, filled
    part by part through :meth:`load_part`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None
        # The weight packed for the panel GEMM, in parts by output rows (a fused q|k|v whose parts the GGUF file
        # stores in different types: one part each); empty while the row-major weight serves.
        self.panels: tuple[PanelWeight, ...] = ()
        self._coded_parts: dict[int, PanelWeight] = {}  # first row -> part, while a GGUF file's parts arrive
        # a GGUF file's parts are computed with int8 activations where their type has that kernel ("gguf-int8")
        self.int8_activations = False

    def use_panel(self) -> bool:
        """Also keep the fp32 weight packed for the panel kernel, which then serves every step.

        Measured on the whole model's linears (2-core AVX2, benchmarks/panel_linear.py): 1.7-2.5x MKL's
        throughput at 1-16 rows, 1.1-1.3x at 32-128, and 1.0-1.15x at 724 (prefill).
        The row-major weight stays until :meth:`release_weight`.
        """
        if self.weight.dtype != torch.float32 or self.weight.shape[0] == 0:
            return False
        self.panels = (panel.pack_fp32(self.weight.data),)
        return True

    def release_weight(self) -> None:
        """Drop the row-major weight once the panels serve every call: each weight is then held once, in the
        format the GEMM reads."""
        if not self.panels:
            raise RuntimeError("release_weight needs packed panels: the weight is the only copy")
        self.weight = empty_parameter(0, self.weight.shape[1], dtype=self.weight.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.panels:
            out = _panel_forward(x, self.panels)
            return out if self.bias is None else out.add_(self.bias)
        w = self.weight
        if w.dtype != x.dtype:
            return F.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
        if x.dim() == 2 and _TRANSPOSED_GEMM_ROWS[0] <= x.shape[0] <= _TRANSPOSED_GEMM_ROWS[1]:
            out = torch.mm(w, x.t()).t()
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, w, self.bias)

    def load_part(self, name: str, offset: int, tensor: Tensor | GGUFTensor) -> None:
        """Copy ``tensor`` into rows ``[offset, offset + len)`` of ``weight`` or ``bias`` (``name``).

        A GGUF file's tensor (native ``weight_format="gguf"``) is packed from its own codes instead, as one part
        of the panels (with ``int8_activations``, its blocks are used as they are, where the int8 GEMM has a
        kernel for the type); once the parts cover every row, they serve every call and the fp32 weight (never
        written, so never resident) goes."""
        if isinstance(tensor, GGUFTensor):
            self._load_coded_part(name, offset, tensor)
            return
        target = self.weight if name == "weight" else self.bias
        if target is None:
            raise ValueError(f"this layer has no {name}, but the checkpoint provides one")
        rows = tensor.shape[0]
        if offset + rows > target.shape[0] or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(
                f"checkpoint {name} of shape {tuple(tensor.shape)} does not fit rows "
                f"[{offset}, {offset + rows}) of a {tuple(target.shape)} parameter: "
                "the config does not match the weights"
            )
        target.data[offset : offset + rows].copy_(tensor)

    def _load_coded_part(self, name: str, offset: int, tensor: GGUFTensor) -> None:
        out_features, in_features = self.weight.shape
        rows = tensor.shape[0]
        if name != "weight" or len(tensor.shape) != 2 or tensor.k != in_features or offset + rows > out_features:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} of shape {tensor.shape} does not fit rows [{offset}, {offset + rows}) "
                f"of a [{out_features}, {in_features}] {name}: the config does not match the weights"
            )
        int8_part = int8_linear.weight(tensor) if self.int8_activations else None
        self._coded_parts[offset] = int8_part or _exact_part(tensor)
        if sum(p.n for p in self._coded_parts.values()) == out_features:
            self.panels = tuple(part for _, part in sorted(self._coded_parts.items()))
            self._coded_parts = {}
            self.release_weight()


def _exact_part(tensor: GGUFTensor) -> PanelWeight:
    """A GGUF tensor packed from its codes for the exact panel GEMM (fp32 where it has no panel format)."""
    if tensor.ggml_type in gguf_blocks.TYPES:
        return gguf_blocks.pack(tensor.data.contiguous(), tensor.ggml_type, tensor.shape[0], tensor.k)
    return panel.pack_fp32(gguf_weights.dequantize_without_kernel(tensor))


def _panel_forward(x: Tensor, panels: tuple[PanelWeight, ...]) -> Tensor:
    """``x W^T`` over the parts of a packed weight: one call per part, each into its columns of one output."""
    if len(panels) == 1:
        return panel.panel_linear(x, panels[0])
    rows = x.reshape(-1, x.shape[-1])
    y = rows.new_empty(rows.shape[0], sum(p.n for p in panels))
    column = 0
    for part in panels:
        panel.panel_linear_into(rows, part, y, column)
        column += part.n
    return y.view(*x.shape[:-1], y.shape[1])


class LMHead(Linear):
    """The vocabulary projection. With bf16 weights, each row's near-maximal logits are recomputed in fp32.

    A bf16 GEMM returns bf16: logits near 25 come back in steps of 0.125, which turns close candidates
    into exact ties and flips greedy choices (measured on the default model: "The" and "L" both became
    25.25). Recomputing the few logits within rounding distance of each row's maximum -- fp32 activations
    times the same bf16 weights -- restores the argmax at a negligible cost; the other logits keep bf16
    rounding, as in any bf16 engine.
    """

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x).contiguous()  # the sampler reads rows: a transposed view made argmax 3x slower
        if self.weight.dtype == torch.float32:
            return logits
        top = logits.amax(dim=-1, keepdim=True)
        rows, cols = (logits >= top - top.abs() * _BF16_TIE_MARGIN - 1e-3).nonzero(as_tuple=True)
        logits[rows, cols] = (x[rows] * self.weight[cols].float()).sum(dim=-1)
        return logits


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in fp32, optionally fused with the residual add before it.

    ``compiled`` (set by the model when its compiled kernels are on) runs one C++ pass per row instead of
    ``F.rms_norm``, whose chain of small ops cost ~150 us a call at decode sizes, 60 calls a step.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_parameter(size, dtype=torch.float32)
        self.eps = eps
        self.compiled = False

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """``rms_norm(x)``; with ``residual``: ``residual += x`` in place first, and the sum is normalised."""
        if self.compiled and x.dim() == 2 and (residual is None or residual.is_contiguous()):
            return kernel_ops.rms_norm(x.contiguous(), self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one GEMM; ``act`` is SiLU (SwiGLU: Llama, Qwen)
    or GeLU with the tanh approximation (GeGLU: Gemma), ``activation`` one of ``spec.ACTIVATIONS``' values.

    ``tp``: this rank's shard -- its rows of gate and up (column-parallel) and down_proj row-parallel, made
    whole on every rank by ``tp.row_parallel``.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallel,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.intermediate = tp.split(intermediate, "MLP width")  # this rank's share
        self.tp = tp
        self.activation = activation
        self.gate_up_proj = Linear(hidden, 2 * self.intermediate, bias, dtype)
        self.down_proj = Linear(*tp.row_parallel_shape(self.intermediate, hidden), bias, dtype)
        self.compiled = False  # one C++ pass for silu(gate) * up (set by the model with its compiled kernels)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu" and self.compiled and gate_up.dim() == 2 and gate_up.is_contiguous():
            hidden = kernel_ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
            hidden = act * up
        return self.tp.row_parallel(self.down_proj, hidden)
