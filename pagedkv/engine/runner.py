"""ModelRunner: owns the model and the KV pools, and turns one scheduled step into flat tensors.

Everything the layers need is built here once per step -- ``input_ids``, ``positions``, the attention
metadata (slot mapping, block tables, ...) and the rows whose logits are sampled -- so the model itself
never does index math per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.kv.manager import KVCacheManager

KV_DTYPE = torch.float32  # attention and the pool stay fp32: bf16 SDPA measured 6-10x slower on this CPU


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one block takes across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(KV_DTYPE).bits // 8


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager) -> None:
        self.model = model
        self.kv = kv
        shape = (kv.num_total_blocks, kv.block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches: list[tuple[Tensor, Tensor]] = [
            (torch.zeros(shape, dtype=KV_DTYPE), torch.zeros(shape, dtype=KV_DTYPE)) for _ in range(model.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> tuple[Tensor, list[tuple[int, int]]]:
        """Run the model on one step, the scheduled requests in any order.

        Returns logits for the requests that reach the end of their known tokens this step (prefill done or
        a decode), and for each of them ``(index in step.scheduled, rows)``, in row order: one logits row,
        or ``1 + k`` consecutive rows for a decode with ``k`` drafts. Unfinished prefill chunks sample nothing.

        The rows are laid out decodes first, as the attention metadata wants (the kernel takes them as one
        slice). A decode with drafts is, for attention, ``1 + k`` one-token requests over the same block
        table with growing lengths: each row sees the drafts before it (all K/V are written before
        attention), and the decode kernel serves them like any other decode.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        block_tables: list[list[int]] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[tuple[int, int]] = []
        decodes_first = sorted(range(len(step.scheduled)), key=lambda i: step.scheduled[i].num_new_tokens > 1)
        for i in decodes_first:
            s = step.scheduled[i]
            request = s.request
            start = request.num_computed_tokens
            end = start + s.num_scheduled_tokens
            input_ids.extend(request.token_ids[start : start + s.num_new_tokens] + s.draft_token_ids)
            positions.extend(range(start, end))
            table = self.kv.block_table(request.request_id)
            rows = 1 + len(s.draft_token_ids)
            if s.draft_token_ids:  # one attention "request" per row, the same blocks, one more token each
                block_tables.extend([table] * rows)
                query_lens.extend([1] * rows)
                seq_lens.extend(range(start + 1, end + 1))
            else:
                block_tables.append(table)
                query_lens.append(s.num_scheduled_tokens)
                seq_lens.append(end)
            if start + s.num_new_tokens == request.num_tokens:
                logits_rows.extend(range(len(input_ids) - rows, len(input_ids)))
                sampled.append((i, rows))
        meta = self.model.attention.build_metadata(block_tables, query_lens, seq_lens, self.kv.block_size)
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            meta,
            self.kv_caches,
            torch.tensor(logits_rows, dtype=torch.int64),
        )
        return logits, sampled
