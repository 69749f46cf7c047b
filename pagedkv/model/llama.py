"""The decoder of every supported family (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3) on the paged KV pool.

What tells the families apart is data in the model's :class:`ModelSpec` (norm form, activation, embedding
scale, q/k norms, softmax scale, Gemma's four norms a layer, each layer's attention window and RoPE), so one
class runs them all. Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE) swap a layer's MLP for the sparse
block of ``model/moe.py``, where the spec says so.

A forward pass takes one flat engine step -- ``T`` tokens of many requests, decodes and prefill chunks
mixed -- plus its :class:`AttentionMetadata` (built by the model's attention backend, the object every
layer attends through) and the per-layer pools. q/k/v and gate/up are fused into one GEMM each (fewer,
larger GEMMs are what a CPU runs fast), RoPE rotates q and k together, and logits are computed only for
the rows the caller samples from. A layer: ``model/decoder_layer.py``.

With tensor parallelism (``tp``, see ``pagedkv.parallel``) each rank holds a Megatron-style shard: its
query and KV heads' columns of q/k/v and its rows of gate/up (column-parallel), the matching columns of
o_proj and down_proj (row-parallel: partial sums, one all-reduce each; or with ``tp.exact``, their output
rows over the gathered input, so each output keeps its full sum), and a slice of the vocabulary for
the embedding (all-reduced) and the LM head (logits gathered to rank 0). Norms are replicated. The weights
are sharded as they are loaded, so the panel GEMM packs only this rank's part.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from pagedkv import kernels
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import AttentionBackend, TorchAttention
from pagedkv.model import gguf_blocks, gguf_weights, int8_linear, panel
from pagedkv.model.decoder_layer import LlamaAttention, LlamaDecoderLayer
from pagedkv.model.decoder_stack import DecoderStack, stack_for
from pagedkv.model.gguf_file import GGUFTensor
from pagedkv.model.layers import WEIGHT_DTYPES, GatedMLP, Linear, LMHead, RMSNorm, empty_parameter
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.model.spec import ModelSpec
from pagedkv.model.weight_names import weight_targets
from pagedkv.parallel.group import SINGLE, TensorParallel

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``weight_format`` (one of ``config.WEIGHT_FORMATS``) sets the linear layers' (and the
    embedding's) weight dtype; all else is fp32. ``attention`` serves every layer (default: torch's);
    ``tp``: this process's tensor-parallel shard (default: the whole model); ``max_model_len``: the engine's limit
    on the context, if it sets one (it decides longrope's factor set: ``pagedkv.model.rope_scaling``)."""

    def __init__(
        self,
        hf_config: Any,
        weight_format: str = "float32",
        attention: AttentionBackend | None = None,
        tp: TensorParallel = SINGLE,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec = ModelSpec.from_hf_config(hf_config, max_model_len)
        self.tp = tp
        weight_dtype = WEIGHT_DTYPES[weight_format]
        self.attention = attention or TorchAttention()
        self.vocab_rows = tp.vocab_rows(spec.vocab_size)  # this rank's slice of the vocabulary
        self.embed_tokens = empty_parameter(self.vocab_rows, spec.hidden_size, dtype=weight_dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, i, weight_dtype, self.attention, tp) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = LMHead(spec.hidden_size, self.vocab_rows, False, weight_dtype)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        for module in self.modules():
            if isinstance(module, Linear):
                module.int8_activations = weight_format == int8_linear.WEIGHT_FORMAT
        # one RoPE table per distinct base: the full-attention layers', then the windowed layers' (Gemma 3); rows
        # up to the served context only (spec.max_model_len: the engine's limit where it sets one)
        ropes = [spec.rope] + ([spec.local_rope] if spec.local_rope is not None else [])
        self.rotary = nn.ModuleList(
            RotaryEmbedding(spec.rotary_dim, spec.max_model_len, rope, spec.max_positions) for rope in ropes
        )
        self.embed_source: GGUFTensor | None = None  # an untied embedding read from a GGUF file in place
        # all layers in one compiled call where they fit it (model/decoder_stack.py); False runs the modules
        self.fused_layers = True
        self._stack: DecoderStack | None | bool = None  # built at the first step: False where it does not fit

    def use_kernels(self, root: nn.Module | None = None) -> Counter[str]:
        """Run norms, SiLU-and-multiply and RoPE on the compiled ops and, where the panel GEMM builds, pack
        every fp32 linear layer (LM head included) for it; returns the number of linear layers per panel format
        (a layer packed from a GGUF file's codes counts each of its parts' formats). A packed layer's row-major
        weight is freed; a tied LM head's too, and the embedding lookup then reads its rows from the panel
        (``panel.rows``, the same bits): one copy of the vocabulary matrix, not two. ``root``: only the modules
        under it (a layer just loaded); packed ones are counted, not packed again.
        """
        gemm = kernels.gemm.available()
        self._stack = None  # the layers may fit the compiled stack now
        formats: Counter[str] = Counter()
        for module in (root or self).modules():
            if isinstance(module, (RMSNorm, GatedMLP, LlamaAttention)):
                module.compiled = True
            if not isinstance(module, Linear):
                continue
            if not module.panels and gemm and module.use_panel():
                tied = module.weight is self.embed_tokens
                module.release_weight()
                if tied:
                    self.embed_tokens = module.weight  # empty now: _embed reads the panel
            formats.update(part.format for part in module.panels)
        return formats

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this process (its shard's, with tensor parallelism): the KV pool's width."""
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[Tensor, Tensor]],
        logits_indices: Tensor,
    ) -> Tensor:
        """fp32 logits ``[len(logits_indices), vocab]`` for chosen rows of the flat step ``input_ids [T]``.

        Only those rows go through the final norm and the LM head, the largest GEMM of a small model.
        """
        return self.compute_logits(self.hidden_states(input_ids, positions, meta, kv_caches, logits_indices))

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[Tensor, Tensor]],
        rows: Tensor,
        window_meta: AttentionMetadata | None = None,
    ) -> Tensor:
        """The final (normed) hidden states ``[len(rows), hidden]`` of chosen rows: what the LM head reads.

        ``window_meta``: the step over the sliding-window layers' own block tables, where the KV manager keeps
        those apart (``pagedkv.kv.hybrid``); None: every layer reads ``meta``'s.

        A caller that needs logits for many rows (scoring a prompt) turns them into logits a slice at a
        time with :meth:`compute_logits`, instead of holding ``rows x vocab`` floats at once.
        """
        if len(kv_caches) != self.spec.num_layers:
            raise ValueError(f"need one (k_pool, v_pool) per layer: {self.spec.num_layers}, got {len(kv_caches)}")
        h = self._embed(input_ids)
        if self.spec.embed_scale != 1.0:
            h.mul_(self.spec.embed_scale)  # an fp32 scalar, as HF multiplies (Gemma: sqrt(hidden))
        tables = [rotary.tables(positions) for rotary in self.rotary]
        if self._stack is None:
            self._stack = stack_for(self) or False
        if self._stack and self.fused_layers:
            h = self._stack(h, tables, meta, kv_caches, window_meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                layer_meta = window_meta if window_meta is not None and layer.self_attn.window else meta
                h = layer(h, *tables[layer.rope], layer_meta, kv_cache)
        return self.norm(h[rows])

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits ``[rows, vocab]`` (on a tensor-parallel worker: its vocabulary slice, also sent to rank 0)."""
        return self.tp.gather_logits(self.lm_head(hidden).float(), self.spec.vocab_size)

    def _embed(self, input_ids: Tensor) -> Tensor:
        if self.tp.world_size == 1:
            return self._embedding_rows(input_ids)
        # each rank looks up the ids in its slice and zeros the others; the sum has every row exactly once
        local = input_ids - self.tp.rank * self.vocab_rows
        outside = (local < 0) | (local >= self.vocab_rows)
        h = self._embedding_rows(local.masked_fill(outside, 0))
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(1), 0.0))

    def _embedding_rows(self, ids: Tensor) -> Tensor:
        if self.embed_source is not None:  # the GGUF file's own rows, de-quantised as they are read
            return gguf_blocks.rows(self.embed_source.data, self.embed_source.ggml_type, ids, self.spec.hidden_size)
        if self.embed_tokens.shape[0] == 0:  # the tied LM head's panel holds the only copy
            return panel.rows(self.lm_head.panels[0], ids)
        return nn.functional.embedding(ids, self.embed_tokens).float()

    def use_file_embedding(self, tensor: GGUFTensor) -> None:
        """The token embedding of a GGUF file read natively: left in the file.

        Untied, lookups de-quantise the few rows a step needs straight from the mapped file (only those pages
        are read). Tied, the LM head packs the file's codes and lookups read the rows back from its panel, as
        for an fp32 tied head: one copy of the vocabulary matrix either way."""
        if self.spec.tie_word_embeddings:
            self.lm_head.load_part("weight", 0, tensor)
        elif tensor.ggml_type not in gguf_blocks.TYPES:  # no kernel reads its rows: fp32, with a warning
            self.embed_tokens.data.copy_(gguf_weights.dequantize_without_kernel(tensor))
            return
        else:
            self.embed_source = tensor
        self.embed_tokens = empty_parameter(0, self.spec.hidden_size, dtype=torch.float32)

    def load_weights(
        self, tensors: Mapping[str, Tensor], after_layer: Callable[[nn.Module], object] | None = None
    ) -> None:
        """Copy a checkpoint given by HF parameter names; raises on missing or unexpected weights.

        Each tensor is read once, when its turn comes, layer after layer, and ``after_layer`` is called on
        each decoder layer once it is complete. With a lazy mapping (the loader's) and packing in
        ``after_layer``, the whole checkpoint is never in memory twice: peak memory stays near the final."""
        targets = weight_targets(self)
        names = {n for n in tensors if not n.endswith(_IGNORED_SUFFIXES)}
        if self.spec.tie_word_embeddings:
            names.discard("lm_head.weight")
        unexpected, missing = sorted(names - targets.keys()), sorted(targets.keys() - names)
        if unexpected or missing:
            raise ValueError(
                f"checkpoint does not match the {self.spec.model_type} config: unexpected weights "
                f"{unexpected[:5]}, missing weights {missing[:5]}"
            )
        layer_of = {n: int(n.split(".")[2]) if n.startswith("model.layers.") else -1 for n in names}
        with torch.no_grad():
            for index in range(-1, len(self.layers)):
                for name in sorted(n for n in names if layer_of[n] == index):
                    targets[name](tensors[name])
                if index >= 0 and after_layer is not None:
                    after_layer(self.layers[index])
