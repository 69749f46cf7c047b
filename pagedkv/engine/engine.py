"""LLMEngine: the engine's public face -- add requests, run steps, read the counters.

``build_engine`` (``pagedkv.engine.builder``) puts the parts together; ``EngineLoop`` (``pagedkv.engine.loop``)
is the step -> process -> stop loop. This class validates and builds requests (``make_requests``, which the
server's tokenizer worker calls too) and drives the loop on the caller's thread: ``LLM`` calls ``step()``
until its requests finish. The server drives the same loop on its engine thread (``pagedkv.engine.async_client``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence

from pagedkv.config import EngineConfig
from pagedkv.engine.builder import build_engine
from pagedkv.engine.loop import EngineLoop
from pagedkv.engine.prompts import encode_text, render_chat
from pagedkv.engine.request import OutputKind, Request, RequestOutput
from pagedkv.errors import InvalidParameter
from pagedkv.kv.events import KVEventBatch, KVEventRecorder
from pagedkv.sampler import make_generator
from pagedkv.sampling_params import SamplingParams
from pagedkv.structured import GrammarCompiler


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine(config)
        self.core, self.processor, self.runner = parts.core, parts.processor, parts.runner
        self.loop = EngineLoop(parts.core, parts.processor)
        # what callers read: the model's facts and the parts inside the core and the runner
        self.tokenizer, self.hf_config = parts.loaded.tokenizer, parts.loaded.hf_config
        self.model_path, self.scheduler, self.kv_events = parts.loaded.path, self.core.scheduler, self.core.kv_events
        self.kv, self.max_model_len = self.scheduler.kv, self.scheduler.max_model_len
        self.eos_token_ids, self.disk = self.scheduler.eos_token_ids, self.kv.disk
        self.workers, self.attention = self.runner.workers, self.runner.model.attention
        self.grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, sorted(self.eos_token_ids))
        self._ids = itertools.count()

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
        """Validate and queue a request, all or nothing: raises ValueError and changes nothing on bad input."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.processor.groups:
            raise ValueError(f"request_id {request_id!r} is already in use: pick a unique id")
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidParameter("prompt", "give a prompt or prompt_token_ids")
            prompt_token_ids = self.encode(prompt)
        requests = self.make_requests(request_id, prompt_token_ids, params, cache_salt)
        self.loop.add([requests], [prompt], output_kind)
        return request_id

    def make_requests(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None
    ) -> list[Request]:
        """The n validated core requests of one prompt, not yet queued; raises InvalidParameter.

        Everything that could fail for this request alone -- validation, the salt's encoding, hashing its
        prompt blocks -- happens here, before anything is registered, so a request that cannot run never
        becomes a half-added group. Reads only the engine's fixed settings, so any thread may call it.
        """
        token_ids = _as_token_ids(prompt_token_ids)
        self._validate(token_ids, params, cache_salt)
        block_size = self.kv.block_size if self.kv.enable_prefix_caching else 0
        structured = params.structured_outputs
        requests: list[Request] = []
        for index in range(params.n):
            scorer = requests[0] if requests and params.prompt_logprobs is not None else None
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
                    scorer=scorer,
                    grammar=None if structured is None else self.grammars.matcher(structured),
                )
            )
        return requests

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
        if params.max_tokens is not None:
            self._check_context(len(token_ids), params.max_tokens)
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

    def _check_context(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Prompt + max_tokens must fit max_model_len, as vLLM's server checks it, in its words (clients match
        on "maximum context length"): a client asking for 10^12 tokens is told so instead of getting whatever
        fits. ``max_tokens_policy="clamp"`` lets it run until the context is full (the scheduler stops it)."""
        requested = num_prompt_tokens + max_tokens
        if requested <= self.max_model_len or self.config.max_tokens_policy == "clamp":
            return
        raise InvalidParameter(
            "max_tokens",
            f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the completion). Please "
            f"reduce the length of the messages or completion: max_tokens may be at most "
            f"{self.max_model_len - num_prompt_tokens} for this prompt.",
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and give its blocks back. False if it is unknown or already done."""
        return self.loop.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that made progress."""
        return self.loop.step()

    # -- cache and counters ---------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget the pool's cached blocks (not the disk tier's: delete kv_cache_dir's files for that)."""
        done = self.kv.reset_prefix_cache()
        self.core.publish_kv_events()  # AllBlocksCleared, now
        return done

    def subscribe_kv_events(self, callback: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Call ``callback(batch)`` with each step's KV cache events from now on (``pagedkv.kv.events``);
        returns the function that unsubscribes. It runs on the engine's thread: keep it short."""
        if self.kv.events is None:
            self.kv.record_events(KVEventRecorder(self.config.block_size))
        return self.kv_events.subscribe(callback)

    def stats(self) -> dict[str, float]:
        return self.core.stats()

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop the tensor-parallel workers, if any (also done when
        the engine is garbage-collected, and at exit)."""
        for part in (self.disk, self.kv_events, self.workers):
            if part is not None:
                part.close()


def _as_token_ids(values: Sequence[int]) -> list[int]:
    """Prompt token ids as a list of Python ints; anything that is not an integer is refused, not rounded."""
    try:
        return [operator.index(t) for t in values]
    except TypeError as exc:
        raise InvalidParameter("prompt", f"prompt token ids must be integers: {exc}") from exc
