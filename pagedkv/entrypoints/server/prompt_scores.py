"""Prompt logprobs in the two shapes clients ask for them.

- The legacy completions ``echo``: the prompt comes back in front of the completion, and with ``logprobs: k``
  its tokens lead the logprobs lists (the first with logprob None). With ``max_tokens: 0`` this is how
  evaluation harnesses (lm-evaluation-harness and others) score a text.
- vLLM's ``prompt_logprobs: k`` extra field: per prompt token, None for the first, else the top-k and the
  actual token by id, each with its logprob, rank and text.
"""

from __future__ import annotations

from pagedkv.engine.request import CompletionOutput, PromptLogprob, RequestOutput
from pagedkv.entrypoints.server.openai_objects import CompletionLogprobs, PromptLogprobs, PromptTokenLogprob
from pagedkv.entrypoints.server.serving import ServingContext, completion_logprobs


def vllm_prompt_logprobs(ctx: ServingContext, entries: list[PromptLogprob | None], k: int) -> PromptLogprobs:
    """The ``prompt_logprobs`` field: the ``k`` best tokens of each position, then the actual one."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        position = {
            str(t): PromptTokenLogprob(logprob=lp, rank=rank, decoded_token=ctx.token_text(t))
            for rank, (t, lp) in enumerate(entry.top_logprobs[:k], start=1)
        }
        position.setdefault(
            str(entry.token_id),
            PromptTokenLogprob(logprob=entry.logprob, rank=entry.rank, decoded_token=ctx.token_text(entry.token_id)),
        )
        out.append(position)
    return out


async def echoed_prompt(ctx: ServingContext, output: RequestOutput) -> str:
    """The prompt as the client sent it: its text, or its token ids decoded."""
    if output.prompt is not None:
        return output.prompt
    return await ctx.engine.tokenizer.decode(output.prompt_token_ids)


def echo_choice(
    ctx: ServingContext, output: RequestOutput, prompt_text: str, sample: CompletionOutput, delta: bool, k: int | None
) -> tuple[str, CompletionLogprobs | None]:
    """A choice's text and logprobs with the prompt in front (``k``: the request's ``logprobs``)."""
    text = prompt_text + (sample.delta_text if delta else sample.text)
    if k is None:
        return text, None
    result = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs or [], strict=True):
        token_text = ctx.token_text(token_id)
        result.tokens.append(token_text)
        result.token_logprobs.append(None if entry is None else entry.logprob)
        result.top_logprobs.append(
            None if entry is None else {ctx.token_text(t): lp for t, lp in entry.top_logprobs[:k]}
        )
        result.text_offset.append(offset)
        offset += len(token_text)
    completion = completion_logprobs(ctx, sample, delta, offset=len(prompt_text))
    if completion is not None:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(result, name).extend(getattr(completion, name))
    return text, result
