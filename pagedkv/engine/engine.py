"""LLMEngine: add requests, run steps, stream outputs. The loop every entrypoint drives.

One ``step()`` = ``EngineCore.step`` -- ``Scheduler.schedule`` (which requests, how many tokens each) ->
``ModelRunner.execute`` (the flat batch through the model) -> ``Sampler`` (one token per row that reached
the end of its known tokens) -> ``Scheduler.update_from_output`` (advance, verify drafts, append,
token-level stops, free) -- then ``OutputProcessor.process`` (detokenize, stop strings, the caller's
RequestOutputs). Each piece of step state has one owner; this class builds and validates requests and
wires the pieces. ``LLM`` just calls ``step()`` until nothing is left; the server runs the core and the
output processor on two threads (``pagedkv.engine.async_client``).
"""

from __future__ import annotations

import itertools
import logging
import operator
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pagedkv import kernels
from pagedkv.attention.backend import select_backend
from pagedkv.config import EngineConfig
from pagedkv.engine import tp_worker
from pagedkv.engine.chat_templates import load_chat_template
from pagedkv.engine.core import EngineCore
from pagedkv.engine.kv_groups import make_kv_manager
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.prompts import encode_text, render_chat
from pagedkv.engine.request import OutputKind, Request, RequestOutput
from pagedkv.engine.runner import ModelRunner, kv_block_bytes
from pagedkv.engine.scheduler import Scheduler
from pagedkv.errors import InvalidParameter
from pagedkv.kv.block_directory import prepare_directory
from pagedkv.kv.disk_fingerprint import engine_fingerprint
from pagedkv.kv.disk_tier import DiskTier
from pagedkv.kv.events import KVEventBatch, KVEventPublisher, KVEventRecorder, check_endpoint
from pagedkv.kv.ops import KV_DTYPES
from pagedkv.model.loader import default_model_path, load_model, model_directory
from pagedkv.parallel import workers
from pagedkv.parallel.group import SINGLE
from pagedkv.sampler import Sampler, make_generator
from pagedkv.sampling_params import SamplingParams
from pagedkv.structured import GrammarCompiler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.kv_cache_dir is not None:  # refused in a moment, before the model loads, not minutes after
            prepare_directory(config.kv_cache_dir)
        if config.kv_events_endpoint is not None:  # the same
            check_endpoint(config.kv_events_endpoint, config.kv_events_allow_remote)
        template = None if config.chat_template is None else load_chat_template(config.chat_template)  # the same
        torch.set_num_threads(workers.rank_threads(config))
        self.attention = select_backend(config.attention_backend)
        self.kernels = kernels.use_kernels(config.kernels)
        self.workers: workers.Workers | None = None  # the other tensor-parallel ranks
        tp = SINGLE
        if config.tensor_parallel_size > 1:
            model_directory(config.model)  # a GGUF file's metadata converted once, here, not by every rank
            model_path = config.model or default_model_path()
            tp_worker.check_divides(model_path, config.tensor_parallel_size, config.tensor_parallel_exact)
            self.workers = workers.start(config, model_path, tp_worker.serve)
            weakref.finalize(self, self.workers.close)
            tp = self.workers.tp
        loaded = load_model(config.model, config.weight_format, self.attention, self.kernels, tp, config.max_model_len)
        self.tokenizer = loaded.tokenizer
        if template is not None:
            self.tokenizer.chat_template = template
        self.hf_config = loaded.hf_config
        self.model_path = loaded.path
        self.weight_format = loaded.weight_format
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        model = loaded.model
        kv_dtype = KV_DTYPES[config.kv_cache_dtype]
        block_bytes = kv_block_bytes(model.num_layers, config.block_size, model.num_kv_heads, model.head_dim, kv_dtype)
        num_blocks = config.num_kv_blocks or max(1, int(config.kv_cache_memory_gb * 2**30) // block_bytes)
        self.kv = make_kv_manager(config, model.spec, num_blocks, tp.world_size)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.num_speculative_tokens,
            self.max_model_len,
            self.eos_token_ids,
            max_seqs_per_group=max(1, int(config.max_seq_share_per_request * config.max_num_seqs)),
            max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
        )
        if self.workers is not None:
            tp.broadcast(torch.tensor([num_blocks]), idle=True)  # each worker's pool: its KV heads, every block
        self.runner = ModelRunner(model, self.kv, tp, self.workers, kv_dtype)
        self.disk: DiskTier | None = None
        if config.kv_cache_dir is not None:
            self.disk = self._open_disk_tier(config)
        self.core = EngineCore(self.scheduler, self.runner, Sampler(eos_token_ids=self.eos_token_ids))
        self.core.kv_events = self.kv_events = KVEventPublisher(
            config.kv_events_endpoint, config.kv_events_allow_remote
        )
        if self.kv_events.endpoint is not None:
            self.kv.record_events(KVEventRecorder(config.block_size))
            weakref.finalize(self, self.kv_events.close)
            logger.info("publishing KV events on %s", self.kv_events.endpoint)
        self.processor = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, sorted(self.eos_token_ids))
        self._ids = itertools.count()
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens (%s, %.2f GiB), max_model_len %d, attention %s, kernels %s",
            self.model_path,
            self.kv.num_total_blocks,
            config.block_size,
            config.kv_cache_dtype,
            sum(k.nbytes + v.nbytes for k, v in self.runner.kv_caches) / 2**30,
            self.max_model_len,
            self.attention.name,
            self.kernels,
        )

    def _open_disk_tier(self, config: EngineConfig) -> DiskTier:
        """The prefix cache's disk tier in ``config.kv_cache_dir``, attached to the pools and the KV manager."""
        directory = Path(config.kv_cache_dir).expanduser()
        fingerprint, covers = engine_fingerprint(
            self.model_path,
            directory / "models",
            weight_format=self.weight_format,
            kernels=self.kernels,
            gemm=self.kernels and kernels.gemm.loaded,
            attention=self.attention.name,
            block_size=config.block_size,
            kv_dtype=self.runner.kv_caches[0][0].dtype,
        )
        disk = DiskTier(directory, fingerprint, int(config.kv_cache_disk_gb * 2**30))
        disk.attach(self.runner.kv_caches)
        self.kv.disk = disk
        weakref.finalize(self, disk.close)  # at exit too: the queued writes are finished
        logger.info("kv_cache_dir %s: fingerprint %s over %s", directory, fingerprint[:16], covers)
        return disk

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
        self.processor.add(self.processor.make_group(requests, prompt, output_kind))
        self.core.add(requests)
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
        if request_id not in self.processor.groups:
            return False
        self.core.finish(self.processor.abort(request_id), "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.groups)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that made progress."""
        outputs, stops = self.processor.process(self.core.step())
        for stop in stops:
            self.core.finish([stop.request_id], stop.reason, stop.stop_reason)
        return outputs

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
        if self.disk is not None:
            self.disk.close()
        self.kv_events.close()
        if self.workers is not None:
            self.workers.close()


def _as_token_ids(values: Sequence[int]) -> list[int]:
    """Prompt token ids as a list of Python ints; anything that is not an integer is refused, not rounded."""
    try:
        return [operator.index(t) for t in values]
    except TypeError as exc:
        raise InvalidParameter("prompt", f"prompt token ids must be integers: {exc}") from exc
