"""Stop checks after each new token, and the RequestOutput a caller sees (cumulative text plus deltas)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.request import CompletionOutput, Request, RequestOutput


def check_stop(
    request: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[str | None, str | int | None]:
    """Feed the new token to the detokenizer and decide whether the request is done.

    Returns ``(finish_reason, stop_reason)``: ``("stop", None)`` for EOS, ``("stop", token)`` for a stop
    token id, ``("stop", "text")`` for a stop string, ``("length", None)`` for max_tokens / max_model_len, and
    ``(None, None)`` to go on. EOS and stop tokens are not added to the text.
    """
    params = request.params
    min_tokens_reached = request.num_output_tokens >= params.min_tokens
    if min_tokens_reached and token in eos_token_ids and not params.ignore_eos:
        request.detokenizer.finish()
        return "stop", None
    if min_tokens_reached and params.stop_token_ids and token in params.stop_token_ids:
        request.detokenizer.finish()
        return "stop", token
    request.detokenizer.add_token(token)
    if min_tokens_reached and request.detokenizer.stop_reason is not None:
        return "stop", request.detokenizer.stop_reason
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        request.detokenizer.finish()
        return "length", None
    if request.num_tokens >= max_model_len:
        request.detokenizer.finish()
        return "length", None
    return None, None


def completion_output(request: Request) -> CompletionOutput:
    """Snapshot one sample, with what is new since the previous snapshot as the delta."""
    text = request.detokenizer.output_text
    tokens = request.output_token_ids
    delta_text, delta_tokens = text[request.emitted_text :], tokens[request.emitted_tokens :]
    request.emitted_text, request.emitted_tokens = len(text), len(tokens)
    wants_logprobs = request.params.logprobs is not None
    return CompletionOutput(
        index=request.index,
        text=text,
        token_ids=tokens,
        delta_text=delta_text,
        delta_token_ids=delta_tokens,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=list(request.logprobs) if wants_logprobs else None,
        top_logprobs=list(request.top_logprobs) if wants_logprobs else None,
    )


def build_output(group_id: str, prompt: str | None, group: Sequence[Request]) -> RequestOutput:
    first = group[0]
    ttft = (first.first_token_time - first.arrival_time) if first.first_token_time else 0.0
    return RequestOutput(
        request_id=group_id,
        prompt=prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[completion_output(r) for r in group],
        num_cached_tokens=first.num_cached_tokens or 0,
        finished=all(r.is_finished for r in group),
        metrics={
            "arrival_time": first.arrival_time,
            "ttft": ttft,
            "last_token_time": first.last_token_time or 0.0,
        },
    )
