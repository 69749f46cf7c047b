"""Stop checks after each new token, and the RequestOutput a caller sees (cumulative text plus deltas)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.request import INTERNAL_ERROR, CompletionOutput, OutputKind, Request, RequestOutput


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
    if min_tokens_reached and token in params.stop_token_id_set:
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
    """Snapshot one sample, with what is new since the previous snapshot as the delta.

    With OutputKind.DELTA the snapshot holds only the new part (text == delta_text), so a stream's outputs
    add up to O(output) bytes instead of O(output^2).
    """
    text = request.detokenizer.output_text
    start_text, start_tokens = request.emitted_text, request.emitted_tokens
    delta_text, delta_tokens = text[start_text:], request.token_ids[request.num_prompt_tokens + start_tokens :]
    request.emitted_text, request.emitted_tokens = len(text), request.num_output_tokens
    delta = request.output_kind is OutputKind.DELTA
    logprobs = top_logprobs = None
    if request.params.logprobs is not None:
        first = start_tokens if delta else 0
        logprobs, top_logprobs = request.logprobs[first:], request.top_logprobs[first:]
    return CompletionOutput(
        index=request.index,
        text=delta_text if delta else text,
        token_ids=delta_tokens if delta else request.output_token_ids,
        delta_text=delta_text,
        delta_token_ids=delta_tokens,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
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
        error=INTERNAL_ERROR if any(r.finish_reason == "error" for r in group) else None,
    )
