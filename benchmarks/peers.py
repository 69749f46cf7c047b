"""The engines pagedkv is compared with, each behind one function returning a ``RunResult``.

HF transformers ``generate`` on a left-padded batch, HF transformers ``generate_batch`` (its continuous
batching on a paged cache), and llama.cpp through llama-cpp-python (one request at a time through its chat
API, which keeps the previous prompt's KV and recomputes only from the first differing token).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass
class RunResult:
    name: str
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    prompt_tokens_computed: int | None
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    outputs: list[list[int]] | None = None
    note: str = ""

    def row(self) -> dict:
        ttft = sorted(self.ttft_ms)
        return {
            "engine": self.name,
            "wall_s": round(self.wall_s, 2),
            "output_tok_s": round(self.output_tokens / self.wall_s, 1),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prefix_hit_rate": None
            if self.prompt_tokens_computed is None
            else round(1 - self.prompt_tokens_computed / self.prompt_tokens, 3),
            "ttft_mean_ms": round(statistics.mean(ttft), 1) if ttft else None,
            "ttft_p50_ms": round(_percentile(ttft, 50), 1) if ttft else None,
            "ttft_p99_ms": round(_percentile(ttft, 99), 1) if ttft else None,
            "tpot_ms": round(statistics.mean(self.tpot_ms), 1) if self.tpot_ms else None,
            "note": self.note,
        }


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


class _StepClock:
    """A stopping criterion that never stops: it only timestamps every decoding step of HF ``generate``."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids: set[int]) -> RunResult:
    from transformers import StoppingCriteriaList

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    wall = time.perf_counter() - start
    outputs = [_trim(row[width:].tolist(), eos_ids) for row in out]
    first = clock.times[0] - start if clock.times else wall
    steps = max(len(clock.times) - 1, 1)
    tpot = (clock.times[-1] - clock.times[0]) / steps * 1000 if len(clock.times) > 1 else 0.0
    return RunResult(
        "HF transformers generate (padded batch)",
        wall,
        sum(len(o) for o in outputs),
        sum(map(len, prompts)),
        sum(map(len, prompts)),
        [first * 1000] * len(prompts),
        [tpot] * len(prompts),
        outputs,
        note=f"batch of {len(prompts)}, left-padded",
    )


def run_hf_generate_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int]) -> RunResult:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos_ids))
    start = time.perf_counter()
    with torch.inference_mode():
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    wall = time.perf_counter() - start
    ordered = sorted(results.values(), key=lambda r: int(str(r.request_id).split("_")[-1]))
    outputs = [_trim(list(r.generated_tokens), eos_ids) for r in ordered]
    return RunResult(
        "HF transformers generate_batch (continuous batching)",
        wall,
        sum(len(o) for o in outputs),
        sum(map(len, prompts)),
        sum(map(len, prompts)),
        outputs=outputs,
        note="paged cache, no prefix reuse",
    )


def run_llama_cpp(
    gguf_path: str, conversations, prompts: list[list[int]], max_new_tokens: int, threads: int
) -> RunResult | None:
    """Sequential chat completions; ``prompts`` are the same conversations tokenized with the same template."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=gguf_path, n_threads=threads, n_threads_batch=threads, n_ctx=4096, verbose=False)
    llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    ttfts, tpots, computed, output_tokens, previous = [], [], 0, 0, []
    start = time.perf_counter()
    for messages, prompt in zip(conversations, prompts):
        sent = time.perf_counter()
        first, pieces = None, 0
        for chunk in llm.create_chat_completion(
            messages=messages, max_tokens=max_new_tokens, temperature=0, stream=True
        ):
            if chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                pieces += 1
        done = time.perf_counter()
        computed += len(prompt) - _common_prefix(previous, prompt)
        previous = prompt
        output_tokens += pieces
        ttfts.append(((first or done) - sent) * 1000)
        tpots.append((done - (first or done)) / max(pieces - 1, 1) * 1000)
    wall = time.perf_counter() - start
    return RunResult(
        "llama.cpp (llama-cpp-python, Q4_1)",
        wall,
        output_tokens,
        sum(map(len, prompts)),
        computed,
        ttfts,
        tpots,
        None,
        note="sequential, reuses the previous prompt's KV",
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _trim(tokens: list[int], eos_ids: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i]
    return tokens
