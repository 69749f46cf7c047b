"""LLMEngine: add requests, run steps, stream outputs. The loop every entrypoint drives.

One ``step()`` = ``Scheduler.schedule`` (which requests, how many tokens each) -> ``ModelRunner.execute``
(the flat batch through the model) -> ``Sampler`` (one token per row that reached the end of its known
tokens) -> ``Scheduler.update_from_output`` (advance, verify drafts, append, token-level stops, free) ->
``OutputProcessor.process`` (detokenize, stop strings, the caller's RequestOutputs). Each piece of step state
has one owner; this class only wires them and keeps a failure with the request it belongs to. Callers
(``LLM``, the HTTP server) just call ``step()`` until nothing is left.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
from collections.abc import Sequence

import torch

from pagedkv.attention.backend import resolve_backend
from pagedkv.config import EngineConfig
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.prompts import encode_text, render_chat
from pagedkv.engine.request import CoreOutput, OutputKind, Request, RequestOutput
from pagedkv.engine.runner import ModelRunner, kv_block_bytes
from pagedkv.engine.scheduler import ScheduledRequest, Scheduler
from pagedkv.errors import InvalidParameter
from pagedkv.kv.manager import KVCacheManager
from pagedkv.model import panel
from pagedkv.model.loader import load_model
from pagedkv.sampler import Sampler, SamplerOutput, make_generator
from pagedkv.sampling import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self.attention_backend = resolve_backend(config.attention_backend)
        self.linear_backend = panel.resolve_backend(config.linear_backend)
        loaded = load_model(config.model, config.dtype, self.attention_backend, self.linear_backend)
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.model_path = loaded.path
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        model = loaded.model
        block_bytes = kv_block_bytes(model.num_layers, config.block_size, model.num_kv_heads, model.head_dim)
        num_blocks = config.num_kv_blocks or max(1, int(config.kv_cache_memory_gb * 2**30) // block_bytes)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.num_speculative_tokens,
            self.max_model_len,
            self.eos_token_ids,
        )
        self.runner = ModelRunner(model, self.kv)
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_model_len %d, attention %s, linear %s",
            self.model_path,
            num_blocks,
            config.block_size,
            self.max_model_len,
            self.attention_backend,
            self.linear_backend,
        )

    # -- requests -------------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return encode_text(self.tokenizer, prompt)

    def apply_chat_template(self, messages: Sequence[dict], **kwargs) -> list[int]:
        return render_chat(self.tokenizer, messages, **kwargs)

    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> str:
        """Validate and queue a request, all or nothing: raises ValueError and changes nothing on bad input.

        Everything that could fail for this request alone -- validation, the salt's encoding, hashing its
        prompt blocks, the detokenizer's start -- happens before it is registered, so a request that cannot
        run never becomes a half-added group that the engine would keep stepping.
        """
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.processor.groups:
            raise ValueError(f"request_id {request_id!r} is already in use: pick a unique id")
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidParameter("prompt", "give a prompt or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        token_ids = _as_token_ids(prompt_token_ids)
        self._validate(token_ids, params, cache_salt)
        block_size = self.kv.block_size if self.kv.enable_prefix_caching else 0
        requests: list[Request] = []
        for index in range(params.n):
            requests.append(
                Request(
                    request_id=f"{request_id}#{index}" if params.n > 1 else request_id,
                    group_id=request_id,
                    index=index,
                    token_ids=list(token_ids),
                    num_prompt_tokens=len(token_ids),
                    params=params,
                    cache_salt=cache_salt,
                    generator=make_generator(None if params.seed is None else (params.seed + index) % 2**64),
                    block_size=block_size,
                    block_keys=list(requests[0].block_keys) if requests else [],  # n samples, one prompt
                )
            )
        group = self.processor.make_group(
            request_id, [r.request_id for r in requests], prompt, token_ids, params, output_kind
        )
        self.processor.add(group)
        for request in requests:
            self.scheduler.add(request)
        return request_id

    def _validate(self, token_ids: list[int], params: SamplingParams, cache_salt: str | None) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not token_ids:
            raise InvalidParameter("prompt", "the prompt is empty: give at least one token")
        vocab = self.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidParameter("prompt", f"prompt token ids must lie in [0, {vocab}) for this model")
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise InvalidParameter("cache_salt", "cache_salt must be a non-empty string (or None)")
            try:
                cache_salt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidParameter(
                    "cache_salt", "cache_salt must be valid Unicode text: it holds a lone surrogate"
                ) from exc
        params.verify_for_model(vocab, self.eos_token_ids)
        if len(token_ids) >= self.max_model_len:
            raise InvalidParameter(
                "prompt",
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: shorten the "
                f"prompt (it must leave room for at least one generated token) or raise max_model_len",
            )
        max_tokens = self.max_model_len - len(token_ids) if params.max_tokens is None else params.max_tokens
        needed = min(len(token_ids) + max_tokens, self.max_model_len)
        capacity = self.kv.num_total_blocks * self.kv.block_size
        if needed > capacity:
            raise InvalidParameter(
                "max_tokens",
                f"this request may need {needed} tokens of KV cache but the whole pool holds {capacity} "
                f"({self.kv.num_total_blocks} blocks of {self.kv.block_size}): lower max_tokens, shorten the "
                f"prompt, or raise num_kv_blocks / kv_cache_memory_gb",
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and give its blocks back. False if it is unknown or already done."""
        if request_id not in self.processor.groups:
            return False
        self.scheduler.finish_requests(self.processor.abort(request_id), "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.groups)

    # -- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that made progress.

        Failures stay with their request: if the batched sampler raises, each request is sampled again on
        its own and only the ones that still fail are stopped; the scheduler and the output processor stop
        a request whose own update raises. Only the model call itself can fail a whole step, and then just
        the requests scheduled in it are stopped, their blocks freed.
        """
        step = self.scheduler.schedule()
        if not step.scheduled:
            return []
        try:
            logits, sampled = self.runner.execute(step)
        except Exception:
            logger.exception("the model step failed; stopping the %d requests scheduled in it", len(step.scheduled))
            return self._process([self.scheduler.fail(s.request) for s in step.scheduled])
        out, failed = self._sample(logits, [(step.scheduled[i], n) for i, n in sampled])
        return self._process(self.scheduler.update_from_output(step, sampled, out, failed))

    def _process(self, core_outputs: list[CoreOutput]) -> list[RequestOutput]:
        outputs, stops = self.processor.process(core_outputs)
        for stop in stops:
            self.scheduler.finish_requests([stop.request_id], stop.reason, stop.stop_reason)
        return outputs

    def _sample(self, logits: torch.Tensor, rows: list[tuple[ScheduledRequest, int]]) -> tuple[SamplerOutput, set[str]]:
        """One batched sampler call; if it raises, each request alone, so only a request at fault fails.

        Returns the per-row output and the ids of requests whose rows could not be sampled (their rows hold 0).
        """
        requests = [s.request for s, n in rows for _ in range(n)]
        try:
            return self._sample_rows(logits, requests), set()
        except Exception:
            logger.exception("the batched sampler failed; sampling each request alone")
        out = SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])
        failed: set[str] = set()
        row = 0
        for s, n in rows:
            try:
                part = self._sample_rows(logits[row : row + n], requests[row : row + n])
            except Exception:
                logger.exception("sampling failed for request %s", s.request.request_id)
                failed.add(s.request.request_id)
                part = SamplerOutput(token_ids=[0] * n)
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs or [0.0] * n
            out.top_logprobs += part.top_logprobs or [None] * n
            row += n
        return out, failed

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """The sampler reads a row's history only for penalties and min_tokens; other rows pass nothing,
        so plain decoding does not copy every request's prompt and output every step."""
        history = [_history(r) for r in requests]
        return self.sampler(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [h[0] for h in history],
            [h[1] for h in history],
        )

    # -- cache and counters ---------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        stats = dict(self.kv.stats())
        stats.update(self.scheduler.counters)
        stats["num_requests_running"] = len(self.scheduler.running)
        stats["num_requests_waiting"] = len(self.scheduler.waiting)
        stats["num_preemptions"] = self.scheduler.num_preemptions
        return stats


def _as_token_ids(values: Sequence[int]) -> list[int]:
    """Prompt token ids as a list of Python ints; anything that is not an integer is refused, not rounded."""
    try:
        return [operator.index(t) for t in values]
    except TypeError as exc:
        raise InvalidParameter("prompt", f"prompt token ids must be integers: {exc}") from exc


def _history(request: Request) -> tuple[Sequence[int], Sequence[int]]:
    """(prompt, output) token ids as far as the sampler needs them for this request's parameters."""
    params = request.params
    if params.has_penalties:
        return request.prompt_token_ids, request.output_token_ids
    if params.min_tokens:
        return (), request.output_token_ids
    return (), ()
