"""ModelRunner: owns the model and the KV pools, and turns one scheduled step into flat tensors.

Everything the layers need is built here once per step -- ``input_ids``, ``positions``, the attention
metadata (slot mapping, block tables, ...) and the rows whose logits are sampled -- so the model itself
never does index math per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pagedkv.engine.pooling import kept_positions
from pagedkv.engine.request import PromptLogprob
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.engine.step_inputs import PooledRange, ScoredRange, StepInputs
from pagedkv.kv import ops
from pagedkv.kv.manager import KVCacheManager
from pagedkv.parallel import wire
from pagedkv.parallel.group import SINGLE, TensorParallel
from pagedkv.parallel.workers import Workers


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V, in a pool of ``dtype``."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


# Prompt scoring (``SamplingParams.prompt_logprobs``): evaluation harnesses score a text by summing its tokens'
# logprobs (the completions call ``echo: true, logprobs: k, max_tokens: 0``). The logits of position ``p``
# give token ``p + 1`` its logprob, so a prompt of P tokens needs the LM head on P - 1 rows, a vocabulary-wide
# row each; they are turned into logprobs a slice of rows at a time, so a long prompt never holds
# ``rows x vocab`` floats at once.
ROWS_PER_SLICE = 256  # 48 MB of logits at a time for a 49,152-token vocabulary


def score_rows(
    compute_logits: Callable[[Tensor], Tensor], hidden: Tensor, targets: list[int], top: int
) -> list[PromptLogprob]:
    """One entry per row of ``hidden`` (final hidden states): the logprob and rank of ``targets[i]`` (the
    token that followed), and the ``top`` most likely tokens, best first, all from the raw logits.

    Every value of a row comes from that row's logits alone (row-wise ops), so a token scores the same
    bits whatever the slice, the step or the batch it was computed in.
    """
    out: list[PromptLogprob] = []
    for first in range(0, len(targets), ROWS_PER_SLICE):
        logprobs = compute_logits(hidden[first : first + ROWS_PER_SLICE]).log_softmax(dim=-1)
        wanted = torch.tensor(targets[first : first + ROWS_PER_SLICE], dtype=torch.int64)
        actual = logprobs.gather(1, wanted.unsqueeze(1))
        ranks = (logprobs > actual).sum(dim=1).add_(1).tolist()
        values, ids = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
        for token, logprob, rank, ids_row, values_row in zip(
            wanted.tolist(), actual.squeeze(1).tolist(), ranks, ids.tolist(), values.tolist(), strict=True
        ):
            out.append(PromptLogprob(token, logprob, rank, list(zip(ids_row, values_row, strict=True))))
    return out


@dataclass(slots=True)
class StepResult:
    """What one model step produced (see :meth:`ModelRunner.execute`)."""

    logits: Tensor  # [rows to sample, vocab]
    sampled: list[tuple[int, int]]  # (index in step.scheduled, rows), in row order
    prompt_logprobs: dict[int, tuple[int, list[PromptLogprob]]]  # index -> (first position, entries)
    # index -> (first position, the final hidden states its pooling keeps)
    pooled: dict[int, tuple[int, Tensor]] = field(default_factory=dict)


class ModelRunner:
    """Turns a scheduled step into :class:`StepInputs` (``prepare``) and runs them (``run``).

    With tensor parallelism (``tp``), rank 0 broadcasts each step's inputs before running them, and every
    worker runs the same inputs on its own shard of the model and of the KV pool.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCacheManager,
        tp: TensorParallel = SINGLE,
        workers: Workers | None = None,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.kv = kv
        self.tp = tp
        self.workers = workers  # rank 0's handle on the other ranks (None: one process, or a worker itself)
        # With sliding-window layers (HybridKVCacheManager) those layers' pools are the windowed group's, its
        # null block included (zeros, never written: the kernel never reads it, the torch backend copies and skips
        # it); the others are the full group's.
        windowed = getattr(kv, "windowed", None)
        self.kv_caches: list[tuple[Tensor, Tensor]] = []
        for layer in range(model.num_layers):
            blocks = windowed.num_pool_blocks if windowed and model.spec.window(layer) else kv.num_total_blocks
            shape = (blocks, kv.block_size, model.num_kv_heads, model.head_dim)
            self.kv_caches.append((torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)))

    def execute(self, step: SchedulerOutput) -> StepResult:
        """Run the model on one step, the scheduled requests in any order.

        Returns logits for the requests that reach the end of their known tokens this step (prefill done or
        a decode), and for each of them ``(index in step.scheduled, rows)``, in row order: one logits row,
        or ``1 + k`` consecutive rows for a decode with ``k`` drafts. Unfinished prefill chunks sample nothing,
        and neither does a prompt that is only scored (``max_tokens=0``). A request scoring its prompt gets
        the prompt logprobs of the positions it computed; the K/V of positions its prefix-cache hit already
        holds is not written again (slot -1), as those blocks may be shared.

        Rows keep the scheduler's order (attention takes requests in any order). A decode with drafts is,
        for attention, a request of ``1 + k`` new tokens like a prefill chunk: each row sees the drafts
        before it, and computes the same bits as a plain decode at its position would.
        """
        inputs, sampled = self.prepare(step)
        if self.workers is None:
            logits, prompt_logprobs, pooled = self.run(inputs)
        else:
            self.workers.check()
            try:
                wire.send_lists(self.tp, inputs.to_wire())
                logits, prompt_logprobs, pooled = self.run(inputs)
            except RuntimeError as exc:
                raise self.workers.failure(exc) from exc  # a rank died, or hangs past the step timeout
        return StepResult(logits, sampled, prompt_logprobs, pooled)

    def prepare(self, step: SchedulerOutput) -> tuple[StepInputs, list[tuple[int, int]]]:
        """The step's flat inputs, and ``(index in step.scheduled, rows)`` of each request sampled."""
        inputs = StepInputs([], [], [], [], [], [], [], [])
        windowed = hasattr(self.kv, "windowed")
        sampled: list[tuple[int, int]] = []
        for i, s in enumerate(step.scheduled):
            request = s.request
            start = request.num_computed_tokens
            end = start + s.num_scheduled_tokens
            first_row = len(inputs.input_ids)
            inputs.input_ids.extend(request.token_ids[start : start + s.num_new_tokens] + s.draft_token_ids)
            if request.scores_prompt and start < request.num_prompt_tokens - 1:
                # position p's logits score token p + 1: the prompt's last position scores nothing
                last = min(start + s.num_new_tokens, request.num_prompt_tokens - 1)
                targets = request.token_ids[start + 1 : last + 1]
                inputs.scored.append(ScoredRange(i, first_row, start + 1, request.params.prompt_logprobs, targets))
                # rows of this chunk inside the prefix-cache hit: a chunk may end before the hit does
                shared = min(request.num_hit_tokens, start + s.num_new_tokens) - start
                inputs.shared_rows.extend(range(first_row, first_row + max(0, shared)))
            if request.params.pooling is not None:
                kept = kept_positions(request.params.pooling, request.num_prompt_tokens, start, end)
                if kept:
                    inputs.pooled.append(PooledRange(i, first_row + kept.start - start, kept.start, len(kept)))
            inputs.positions.extend(range(start, end))
            inputs.block_tables.append(self.kv.block_table(request.request_id))
            if windowed:
                inputs.window_block_tables.append(self.kv.window_block_table(request.request_id))
            inputs.query_lens.append(s.num_scheduled_tokens)
            inputs.seq_lens.append(end)
            rows = 1 + len(s.draft_token_ids)
            if s.is_sampled:
                inputs.sampled_rows.extend(range(len(inputs.input_ids) - rows, len(inputs.input_ids)))
                sampled.append((i, rows))
        return inputs, sampled

    @torch.inference_mode()
    def run(
        self, inputs: StepInputs
    ) -> tuple[Tensor, dict[int, tuple[int, list[PromptLogprob]]], dict[int, tuple[int, Tensor]]]:
        """The logits of the sampled rows, and by request index the prompt logprobs of each scored range and
        the final hidden states of each pooled range.

        On a tensor-parallel worker the logits are its vocabulary slice and nothing is scored: it only takes
        part in the same collectives, in the same order, as rank 0.
        """
        meta = self.model.attention.build_metadata(
            inputs.block_tables, inputs.query_lens, inputs.seq_lens, self.kv.block_size
        )
        window_meta = None
        if inputs.window_block_tables:  # the windowed layers' own block tables (HybridKVCacheManager)
            window_meta = self.model.attention.build_metadata(
                inputs.window_block_tables, inputs.query_lens, inputs.seq_lens, self.kv.block_size
            )
        if inputs.shared_rows:
            meta.slot_mapping[inputs.shared_rows] = ops.PAD_SLOT
            if window_meta is not None:
                window_meta.slot_mapping[inputs.shared_rows] = ops.PAD_SLOT
        scoring_rows = [r.first_row + i for r in inputs.scored for i in range(len(r.targets))]
        pooled_rows = [r.first_row + i for r in inputs.pooled for i in range(r.count)]
        hidden = self.model.hidden_states(
            torch.tensor(inputs.input_ids, dtype=torch.int64),
            torch.tensor(inputs.positions, dtype=torch.int64),
            meta,
            self.kv_caches,
            torch.tensor(inputs.sampled_rows + scoring_rows + pooled_rows, dtype=torch.int64),
            window_meta,
        )
        num_sampled, num_scoring = len(inputs.sampled_rows), len(scoring_rows)
        logits = self.model.compute_logits(hidden[:num_sampled])
        pooled_hidden = hidden[num_sampled + num_scoring :].split([r.count for r in inputs.pooled])
        pooled = {r.index: (r.first_position, rows.clone()) for r, rows in zip(inputs.pooled, pooled_hidden)}
        prompt_logprobs: dict[int, tuple[int, list[PromptLogprob]]] = {}
        scored_rows = hidden[num_sampled : num_sampled + num_scoring].split([len(r.targets) for r in inputs.scored])
        for scored, rows in zip(inputs.scored, scored_rows, strict=True):
            if self.tp.is_driver:
                entries = score_rows(self.model.compute_logits, rows, scored.targets, scored.top)
                prompt_logprobs[scored.index] = (scored.first_position, entries)
            else:  # the same LM-head gathers as rank 0's score_rows, a slice at a time
                for first in range(0, len(rows), ROWS_PER_SLICE):
                    self.model.compute_logits(rows[first : first + ROWS_PER_SLICE])
        return logits, prompt_logprobs, pooled
