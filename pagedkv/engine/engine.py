"""LLMEngine: add requests, run steps, stream outputs. The loop every entrypoint drives.

One ``step()`` = schedule (which requests, how many tokens each) -> run the model on the flat batch ->
sample one token per request whose known tokens are all computed -> append, detokenize, check stops ->
free finished requests' blocks. Callers (``LLM``, the HTTP server) just call ``step()`` until nothing is left.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import time
from collections.abc import Sequence

import torch

from pagedkv.attention.backend import resolve_backend
from pagedkv.config import EngineConfig
from pagedkv.engine import speculative
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.outputs import build_output, check_stop
from pagedkv.engine.prompts import encode_text, render_chat
from pagedkv.engine.request import OutputKind, Request, RequestOutput
from pagedkv.engine.runner import ModelRunner, kv_block_bytes
from pagedkv.engine.scheduler import ScheduledRequest, Scheduler
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
        )
        self.runner = ModelRunner(model, self.kv)
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids)
        self.groups: dict[str, list[Request]] = {}
        self.prompts: dict[str, str | None] = {}
        self.counters = {
            "prompt_tokens_computed": 0,
            "generation_tokens": 0,
            "requests_finished": 0,
            "draft_tokens": 0,
            "draft_tokens_accepted": 0,
            "requests_failed": 0,
        }
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
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use: pick a unique id")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        token_ids = _as_token_ids(prompt_token_ids)
        self._validate(token_ids, params, cache_salt)
        group = []
        for index in range(params.n):
            request = Request(
                request_id=f"{request_id}#{index}" if params.n > 1 else request_id,
                group_id=request_id,
                index=index,
                token_ids=list(token_ids),
                num_prompt_tokens=len(token_ids),
                params=params,
                cache_salt=cache_salt,
                generator=make_generator(None if params.seed is None else (params.seed + index) % 2**64),
                detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params),
                output_kind=output_kind,
            )
            if group:  # the n samples share the prompt, so they share its block keys
                request.block_keys = list(group[0].block_keys)
            else:
                self.scheduler.extend_keys(request, len(token_ids) // self.kv.block_size)
            group.append(request)
        self.groups[request_id] = group
        self.prompts[request_id] = prompt
        for request in group:
            self.scheduler.add(request)
        return request_id

    def _validate(self, token_ids: list[int], params: SamplingParams, cache_salt: str | None) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}) for this model")
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError("cache_salt must be a non-empty string (or None)")
            try:
                cache_salt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError("cache_salt must be valid Unicode text: it holds a lone surrogate") from exc
        params.verify_for_model(vocab, self.eos_token_ids)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: shorten the "
                f"prompt (it must leave room for at least one generated token) or raise max_model_len"
            )
        max_tokens = self.max_model_len - len(token_ids) if params.max_tokens is None else params.max_tokens
        needed = min(len(token_ids) + max_tokens, self.max_model_len)
        capacity = self.kv.num_total_blocks * self.kv.block_size
        if needed > capacity:
            raise ValueError(
                f"this request may need {needed} tokens of KV cache but the whole pool holds {capacity} "
                f"({self.kv.num_total_blocks} blocks of {self.kv.block_size}): lower max_tokens, shorten the "
                f"prompt, or raise num_kv_blocks / kv_cache_memory_gb"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and give its blocks back. False if it is unknown or already done."""
        group = self.groups.pop(request_id, None)
        self.prompts.pop(request_id, None)
        if group is None:
            return False
        for request in group:
            if not request.is_finished:
                self.scheduler.finish(request, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that made progress.

        Failures stay with their request: if the batched sampler raises, each request is sampled again on
        its own and only the ones that still fail are stopped; an exception while appending a token
        (detokenizing, stop strings, hashing) stops that request alone. Only the model call itself can
        fail a whole step, and then just the requests scheduled in it are stopped, their blocks freed.
        """
        step = self.scheduler.schedule()
        if not step.scheduled:
            return []
        touched: dict[str, None] = {}
        try:
            logits, sampled = self.runner.execute(step)
        except Exception:
            logger.exception("the model step failed; stopping the %d requests scheduled in it", len(step.scheduled))
            for s in step.scheduled:
                self._fail(s.request, touched)
            return self._collect_outputs(touched)
        for s in step.scheduled:
            if s.draft_token_ids:
                continue  # how many of its tokens count is known once the drafts are checked
            request = s.request
            start = request.num_computed_tokens
            request.num_computed_tokens += s.num_new_tokens
            self.counters["prompt_tokens_computed"] += max(
                0, min(request.num_prompt_tokens, request.num_computed_tokens) - start
            )
            self._guarded(request, touched, self._cache_full_blocks, request)
        if sampled:
            rows = [(step.scheduled[i], n) for i, n in sampled]
            out, failed = self._sample(logits, rows)
            now = time.perf_counter()
            row = 0
            for s, n in rows:
                touched[s.request.group_id] = None
                if s.request.request_id in failed:
                    self._fail(s.request, touched)
                elif s.draft_token_ids:
                    self._guarded(s.request, touched, self._accept_drafts, s, row, out, now)
                elif not s.request.is_finished:
                    self._guarded(s.request, touched, self._append_token, s.request, row, out, now)
                row += n
        return self._collect_outputs(touched)

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
        return self.sampler(
            logits,
            [r.params for r in requests],
            [r.generator for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests],
        )

    def _guarded(self, request: Request, touched: dict[str, None], work, *args) -> None:
        """Run ``work(*args)`` for one request; if it raises, stop that request (and only it)."""
        try:
            work(*args)
        except Exception:
            logger.exception("request %s failed; stopping it", request.request_id)
            self._fail(request, touched)

    def _fail(self, request: Request, touched: dict[str, None]) -> None:
        """Stop a request with finish_reason "error" and free its blocks; its group reports the error."""
        touched[request.group_id] = None
        if not request.is_finished:
            self.scheduler.finish(request, "error")
            self.counters["requests_failed"] += 1

    def _accept_drafts(self, s: ScheduledRequest, row: int, out, now: float) -> None:
        """Keep the drafts the model agreed with and its own token after them; the rest are forgotten.

        The step computed K/V for the last token and every draft, but only the accepted drafts' entries are
        right (a rejected draft was not the real token): the request counts those as computed, and the
        wrong slots are simply overwritten later. Full blocks are cached only up to verified tokens.
        """
        request = s.request
        chosen = out.token_ids[row : row + 1 + len(s.draft_token_ids)]
        accepted = speculative.accepted_length(s.draft_token_ids, chosen)
        self.counters["draft_tokens"] += len(s.draft_token_ids)
        self.counters["draft_tokens_accepted"] += accepted
        request.num_computed_tokens += 1 + accepted
        for j in range(accepted + 1):
            self._append_token(request, row + j, out, now)
            if request.is_finished:
                return
        self._cache_full_blocks(request)

    def _cache_full_blocks(self, request: Request) -> None:
        if not self.kv.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.kv.block_size
        self.scheduler.extend_keys(request, num_full)
        self.kv.cache_full_blocks(request.request_id, request.block_keys, num_full)

    def _append_token(self, request: Request, row: int, out, now: float) -> None:
        token = out.token_ids[row]
        request.token_ids.append(token)
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        self.counters["generation_tokens"] += 1
        if request.params.logprobs is not None and out.logprobs is not None:
            request.logprobs.append(out.logprobs[row])
            request.top_logprobs.append(out.top_logprobs[row] or [])
        reason, stop_reason = check_stop(request, token, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.scheduler.finish(request, reason, stop_reason)
            self.counters["requests_finished"] += 1

    def _collect_outputs(self, touched: dict[str, None]) -> list[RequestOutput]:
        outputs = []
        for group_id in touched:
            group = self.groups.get(group_id)
            if group is None:
                continue
            finished = all(r.is_finished for r in group)
            if not finished and group[0].output_kind is OutputKind.FINAL_ONLY:
                continue
            output = build_output(group_id, self.prompts[group_id], group)
            outputs.append(output)
            if finished:
                del self.groups[group_id]
                del self.prompts[group_id]
        return outputs

    # -- cache and counters ---------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        stats = dict(self.kv.stats())
        stats.update(self.counters)
        stats["num_requests_running"] = len(self.scheduler.running)
        stats["num_requests_waiting"] = len(self.scheduler.waiting)
        stats["num_preemptions"] = self.scheduler.num_preemptions
        return stats


def _as_token_ids(values: Sequence[int]) -> list[int]:
    """Prompt token ids as a list of Python ints; anything that is not an integer is refused, not rounded."""
    try:
        return [operator.index(t) for t in values]
    except TypeError as exc:
        raise ValueError(f"prompt token ids must be integers: {exc}") from exc
