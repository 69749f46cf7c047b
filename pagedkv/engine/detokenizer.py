"""Incremental detokenization and stop strings: text deltas for streaming, without re-decoding the output.

Decoding token by token is wrong (a byte-level BPE token may hold half a UTF-8 character, and SentencePiece
tokenizers drop the leading space of whatever token starts a decode), and re-decoding the whole output each
step is quadratic. So, like vLLM and HF's TextStreamer, each step decodes only a small window:

    window:  | tokens emitted last time | tokens not emitted yet |
             0                          read                     end
             '------ prefix_text -------'
             '-------------------- new_text ---------------------'

The delta is new_text minus prefix_text (vLLM's prefix_offset / read_offset). Both start at the same token,
so whatever the tokenizer does at the start of a decode affects both alike. While new_text ends in U+FFFD
a multi-byte character is still incomplete: nothing is emitted and the window grows until it completes;
once text is emitted, the window drops all but the tokens just emitted. The first window starts with
the prompt's last few tokens, so the first output token decodes in context, as vLLM does.

Stop strings are matched on the decoded text, so they may span any number of tokens. While streaming, the
longest tail of the text that could still grow into a stop string is held back (it would have to be taken
back if the stop completed); `finish()` releases it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.sampling import SamplingParams

# Prompt tokens the first window starts with: enough for the decode of the first output token to see
# its left neighbours (leading-space and byte-merging rules), few enough to cost nothing.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def make_decode(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A `ids -> text` function for the tokenizer, without text clean-up (which is not incremental).

    HF fast tokenizers are decoded through their Rust backend: the same text as `tokenizer.decode`
    without clean-up, at ~2 µs instead of ~20 µs per call. A bare `tokenizers.Tokenizer` works as is.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and not hasattr(tokenizer, "convert_ids_to_tokens"):
        backend = tokenizer
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class StopStringMatcher:
    """Finds stop strings in text that grows by deltas.

    `find(text, start)` looks only at occurrences that end at or after `start` (the length before the latest
    delta), since earlier text was already searched. Among those it takes the stop string that completes
    first (earliest end, then earliest start): the one a character-by-character stream would have hit
    first, so the result does not depend on how the text was split into deltas.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        self.stop = list(stop)
        self.include = include_stop_str_in_output

    def find(self, text: str, start: int) -> tuple[str, int] | None:
        """(matched stop string, length of text to keep) for the first completed stop string, else None."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            begin = text.find(s, max(0, start - len(s) + 1))
            if begin >= 0 and (best is None or (begin + len(s), begin) < best[:2]):
                best = (begin + len(s), begin, s)
        if best is None:
            return None
        end, begin, s = best
        return s, (end if self.include else begin)

    def holdback(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string (0 if the stop
        string would be kept in the output anyway: then nothing emitted ever has to be taken back)."""
        if self.include:
            return 0
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


class IncrementalDetokenizer:
    """Turns one request's output tokens into streamed text, applying its stop strings.

    add_token(id) -> the newly printable text: "" while a character is incomplete, a special token is
    skipped, or a possible start of a stop string is held back. finish() -> whatever was still held back.

    output_text: the concatenation of every delta returned so far. It only ever grows (text that a stop
    string could still take back is not in it yet), so a caller may stream `output_text[len(seen):]`
    instead of using the returned deltas. It ends before the matched stop string, or after it with
    include_stop_str_in_output. stop_reason: the stop string that matched, else None; once set, the
    request should finish with finish_reason "stop", output_text is final, and add_token returns "".
    num_tokens: output tokens added so far (a stop_token included). Stop strings are searched only once
    more than `min_tokens` tokens exist, as in vLLM.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._decode = make_decode(tokenizer, params.skip_special_tokens)
        include = params.include_stop_str_in_output
        self._stop = StopStringMatcher(params.stop, include) if params.stop else None
        self._include_stop_token = include
        self._min_tokens = params.min_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            # A prompt that ends inside a character would swallow the output's first bytes: decode alone.
            context = []
        # The decode window: ids[:read] were emitted already (prefix_text is their text), ids[read:] pend.
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_text: str | None = None
        self._text = ""  # all text decoded so far, cut at a matched stop string; output_text is a prefix
        self._finished = False
        self.num_tokens = 0
        self.output_text = ""
        self.stop_reason: str | None = None

    def add_token(self, token_id: int, *, stop_token: bool = False) -> str:
        """Add one sampled token; returns the text that became printable.

        stop_token=True marks the token that ended the request on EOS or stop_token_ids: like vLLM, its
        text is left out unless include_stop_str_in_output. Call finish() after it.
        """
        if self._finished:
            raise RuntimeError("add_token() after finish(): create a new IncrementalDetokenizer per request")
        if self.stop_reason is not None:
            return ""
        self.num_tokens += 1
        if stop_token and not self._include_stop_token:
            return ""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._advance(new_text[len(self._prefix_text) :])

    def finish(self) -> str:
        """Flush once: decode incomplete bytes as the tokenizer would (U+FFFD), release held-back text."""
        if self._finished:
            return ""
        self._finished = True
        flushed = ""
        if self.stop_reason is None and self._read < len(self._ids):
            prefix_text = self._prefix_text
            if prefix_text is None:
                prefix_text = self._decode(self._ids[: self._read])
            new_text = self._decode(self._ids)
            if len(new_text) > len(prefix_text):
                flushed = self._advance(new_text[len(prefix_text) :])
        return flushed + self._emit(len(self._text))

    def _advance(self, delta: str) -> str:
        """Commit a decoded delta, slide the window forward, apply stop strings, return what to emit."""
        # The pending tokens become the next window's left context; older ones are no longer needed.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = None

        start = len(self._text)
        self._text += delta
        if self._stop is None:
            return self._emit(len(self._text))
        if self.num_tokens > self._min_tokens and (match := self._stop.find(self._text, start)):
            self.stop_reason, keep = match
            self._text = self._text[:keep]
            return self._emit(keep)
        held = 0 if self._finished else self._stop.holdback(self._text)
        return self._emit(len(self._text) - held)

    def _emit(self, end: int) -> str:
        """Move output_text forward to _text[:end] and return the new part (held-back text never was in
        output_text, so a stop string never has to take back emitted text)."""
        delta = self._text[len(self.output_text) : max(end, len(self.output_text))]
        self.output_text += delta
        return delta
