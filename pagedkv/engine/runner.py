"""ModelRunner: owns the model and the KV pools, and turns one scheduled step into flat tensors.

Everything the layers need is built here once per step -- ``input_ids``, ``positions``, the attention
metadata (slot mapping, block tables, ...) and the rows whose logits are sampled -- so the model itself
never does index math per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedkv.engine.request import PromptLogprob
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.engine.scoring import score_rows
from pagedkv.kv import ops
from pagedkv.kv.manager import KVCacheManager

KV_DTYPE = torch.float32  # attention and the pool stay fp32: bf16 SDPA measured 6-10x slower on this CPU


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one block takes across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(KV_DTYPE).bits // 8


@dataclass(slots=True)
class StepResult:
    """What one model step produced (see :meth:`ModelRunner.execute`)."""

    logits: Tensor  # [rows to sample, vocab]
    sampled: list[tuple[int, int]]  # (index in step.scheduled, rows), in row order
    prompt_logprobs: dict[int, tuple[int, list[PromptLogprob]]]  # index -> (first position, entries)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager) -> None:
        self.model = model
        self.kv = kv
        shape = (kv.num_total_blocks, kv.block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches: list[tuple[Tensor, Tensor]] = [
            (torch.zeros(shape, dtype=KV_DTYPE), torch.zeros(shape, dtype=KV_DTYPE)) for _ in range(model.num_layers)
        ]

    @torch.inference_mode()
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
        input_ids: list[int] = []
        positions: list[int] = []
        block_tables: list[list[int]] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[tuple[int, int]] = []
        scored: list[tuple[int, int, int, int]] = []  # (index in step.scheduled, first row, positions [a, b))
        shared_rows: list[int] = []  # rows whose K/V is already in a shared cached block
        for i, s in enumerate(step.scheduled):
            request = s.request
            start = request.num_computed_tokens
            end = start + s.num_scheduled_tokens
            first_row = len(input_ids)
            input_ids.extend(request.token_ids[start : start + s.num_new_tokens] + s.draft_token_ids)
            if request.scores_prompt and start < request.num_prompt_tokens - 1:
                # position p's logits score token p + 1: the prompt's last position scores nothing
                scored.append((i, first_row, start, min(start + s.num_new_tokens, request.num_prompt_tokens - 1)))
                shared_rows.extend(range(first_row, first_row + max(0, request.num_hit_tokens - start)))
            positions.extend(range(start, end))
            block_tables.append(self.kv.block_table(request.request_id))
            query_lens.append(s.num_scheduled_tokens)
            seq_lens.append(end)
            rows = 1 + len(s.draft_token_ids)
            if s.is_sampled:
                logits_rows.extend(range(len(input_ids) - rows, len(input_ids)))
                sampled.append((i, rows))
        meta = self.model.attention.build_metadata(block_tables, query_lens, seq_lens, self.kv.block_size)
        if shared_rows:
            meta.slot_mapping[shared_rows] = ops.PAD_SLOT
        scoring_rows = [row for _, first_row, a, b in scored for row in range(first_row, first_row + b - a)]
        hidden = self.model.hidden_states(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            meta,
            self.kv_caches,
            torch.tensor(logits_rows + scoring_rows, dtype=torch.int64),
        )
        logits = self.model.compute_logits(hidden[: len(logits_rows)])
        prompt_logprobs: dict[int, tuple[int, list[PromptLogprob]]] = {}
        row = len(logits_rows)
        for i, _, a, b in scored:
            request = step.scheduled[i].request
            top = request.params.prompt_logprobs
            targets = request.token_ids[a + 1 : b + 1]
            prompt_logprobs[i] = (a + 1, score_rows(self.model.compute_logits, hidden[row : row + b - a], targets, top))
            row += b - a
        return StepResult(logits, sampled, prompt_logprobs)
