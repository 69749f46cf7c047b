"""LLM: offline batched generation, the way vLLM's ``LLM`` class is used."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.request import OutputKind, RequestOutput
from pagedkv.kv.events import KVEventBatch
from pagedkv.kv.snapshot import read_engine, snapshot_json
from pagedkv.sampling_params import SamplingParams

Messages = Sequence[dict[str, str]]


class LLM:
    """``LLM(model=..., **engine_options)``; no model means the default SmolLM2-135M-Instruct GGUF."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown LLM option(s) {sorted(unknown)}; valid ones: {EngineConfig.field_names()}")
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def embed(
        self,
        prompts: str | Sequence[str] | None = None,
        pooling: str = "last",
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Embed every prompt: ``output.embedding`` is its final hidden states pooled ("last" token or
        "mean") and L2-normalised (see :mod:`pagedkv.engine.pooling`); batched and prefix-cached like
        generation, nothing sampled."""
        params = SamplingParams(max_tokens=0, pooling=pooling)
        return self.generate(prompts, params, prompt_token_ids, use_tqdm, cache_salt)

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) together; outputs come back in input order.

        A request the engine had to stop comes back with finish_reason "error" (and ``error`` set) while
        the others complete; bad input raises ValueError before anything runs.
        """
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("give prompts or prompt_token_ids, not both")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None:
            token_lists = [self.engine.encode(p) for p in prompts]
            texts: list[str | None] = list(prompts)
        elif prompt_token_ids is not None:
            token_lists = [list(t) for t in prompt_token_ids]
            texts = [None] * len(token_lists)
        else:
            raise ValueError("give prompts or prompt_token_ids")
        return self._run(texts, token_lists, sampling_params, use_tqdm, cache_salt)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [self.engine.apply_chat_template(c) for c in conversations]
        return self._run([None] * len(token_lists), token_lists, sampling_params, use_tqdm, cache_salt)

    def _run(
        self,
        texts: list[str | None],
        token_lists: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        """Add every prompt, step until all finish; on any exception (Ctrl-C included) abort what was added,
        so the engine is clean for the next call. Only final outputs are built (no per-step copies)."""
        params = _per_prompt(sampling_params, len(token_lists))
        ids: list[str] = []
        bar = tqdm(total=len(token_lists), desc="generate", disable=not use_tqdm or len(token_lists) < 2, leave=False)
        try:
            for text, tokens, p in zip(texts, token_lists, params):
                ids.append(
                    self.engine.add_request(
                        prompt=text,
                        prompt_token_ids=tokens,
                        params=p,
                        cache_salt=cache_salt,
                        output_kind=OutputKind.FINAL_ONLY,
                    )
                )
            finished: dict[str, RequestOutput] = {}
            wanted = set(ids)
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Finish the disk tier's queued writes (kv_cache_dir) and stop tensor-parallel workers; also done when
        the LLM is garbage-collected and at exit."""
        self.engine.close()

    def subscribe_kv_events(self, callback: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Call ``callback(batch)`` with each step's KV cache events, in vLLM's format (blocks stored, removed,
        all cleared; ``pagedkv.kv.events``); returns the function that unsubscribes."""
        return self.engine.subscribe_kv_events(callback)

    def kv_map(self) -> dict:
        """The KV map's data, as the server's ``GET /kv.json`` serves it: every block's state, the hottest
        cached prefixes and the counters over time (``pagedkv.kv.snapshot``)."""
        return snapshot_json(read_engine(self.engine.core))

    def save_kv_map(self, path: str | os.PathLike) -> Path:
        """Draw the KV map to a PNG at ``path`` (needs matplotlib: ``pip install 'pagedkv[plot]'``)."""
        from pagedkv.kv_map import save_kv_map

        return save_kv_map(self.kv_map(), path)


def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {count} prompts: give one, or one per prompt")
    return list(sampling_params)
