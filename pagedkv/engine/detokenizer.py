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
the prompt's last few tokens, so the first output token decodes in context, as vLLM does. Fast (Rust)
tokenizers run the same algorithm in `tokenizers.decoders.DecodeStream`; others run it here.

Stop strings are matched on the decoded text, so they may span any number of tokens. While streaming, the
longest tail of the text that could still grow into a stop string is held back (it would have to be taken
back if the stop completed); `finish()` releases it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagedkv.sampling_params import SamplingParams

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
        backend = tokenizer  # a bare tokenizers.Tokenizer, or anything with decode(ids, skip_special_tokens)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class _WindowDecoder:
    """The decode window of the module docstring, for any tokenizer with a `decode`.

    step(id) -> the text that id completes ("" while a character is incomplete); flush() -> what is still
    pending, incomplete bytes decoded as the tokenizer does (U+FFFD).
    """

    def __init__(self, decode: Callable[[list[int]], str], context: list[int]) -> None:
        self._decode = decode
        self._ids = context  # ids[:read] were emitted already (prefix_text is their text), ids[read:] pend
        self._read = len(context)
        self._prefix_text: str | None = None

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The pending tokens become the next window's left context; older ones are no longer needed.
        delta = new_text[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read, self._prefix_text = len(self._ids), None
        return delta

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[: self._read]) if self._prefix_text is None else self._prefix_text
        return self._decode(self._ids)[len(prefix_text) :]


class _StreamDecoder:
    """The same window in Rust, `tokenizers.decoders.DecodeStream`, for fast tokenizers: 0.64 µs a token
    instead of 2.3 µs with SmolLM2's tokenizer (AMD EPYC Zen 4). DecodeStream never flushes an incomplete
    character, so the ids since its last chunk are kept here for `flush`."""

    def __init__(self, backend: Tokenizer, decode: Callable[[list[int]], str], context: list[int], skip: bool) -> None:
        self._backend, self._decode = backend, decode
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip)
        self._last: list[int] = context  # the ids of the last chunk: flush()'s left context
        self._pending: list[int] = []

    def step(self, token_id: int) -> str:
        self._pending.append(token_id)
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return ""
        self._last, self._pending = self._pending, []
        return chunk

    def flush(self) -> str:
        if not self._pending:
            return ""
        return self._decode(self._last + self._pending)[len(self._decode(self._last)) :]


class StopStringMatcher:
    """An Aho-Corasick automaton over one request's stop strings, fed the decoded text delta by delta.

    It runs for every token of every sequence, on the one thread that does every request's text work, so a
    request's stop strings must cost it alone, not the other clients. Trying each prefix of each stop string
    against the end of the text (`text.endswith(s[:k])` for every k) costs O(len(s)^2) per stop string per
    token: within the server's caps (32 stop strings of 256 characters), 32 copies of "abcdefgh"*32 while
    the output keeps ending in "abcdefghabc" took ~0.85 ms per token per sequence on the 2-core test
    machine, so 64 such sequences added ~55 ms to every step. Here the state is a trie node (the longest
    tail of the text that is a prefix of a stop string) that each new character moves along trie and
    failure links: amortised O(1) per character whatever the stop strings, ~1.3 µs per token for that
    request on the same machine, 0.4-1.2 µs for one or two short ones (1-3 µs before). The tables are
    built once (~6 ms and 0.5 MB for 32 random stop strings of 256 characters) and shared by the
    request's samples (`_shared_stop_matcher`).

    The state is the caller's (an int, 0 before any text): `scan` advances it over a delta and, if asked,
    reports the stop string that completes first in it (earliest end, then earliest start: the longest one
    ending there), as a character-by-character scan would, so the result does not depend on how the text
    was split into deltas. `held[state]` is how much of the text's tail to hold back: the longest proper
    prefix of a stop string that the text ends with, or 0 with include_stop_str_in_output (then nothing
    emitted ever has to be taken back).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        self.include = include_stop_str_in_output
        children: list[dict[str, int]] = [{}]  # the trie, node 0 the root (the empty prefix)
        ends: dict[int, str] = {}
        for s in dict.fromkeys(stop):
            node = 0
            for c in s:
                node = children[node].setdefault(c, len(children))
                if node == len(children):
                    children.append({})
            ends[node] = s
        # Breadth first, so that each node's failure link (the longest proper suffix of its prefix that is
        # a node too) is shallower and finished before it: done = the longest stop string ending here.
        n = len(children)
        fail, held, depth = [0] * n, [0] * n, [0] * n
        done = [ends.get(node) for node in range(n)]
        order = [0]
        for node in order:
            f = fail[node]
            done[node] = done[node] or done[f]
            if not self.include:
                held[node] = depth[node] if children[node] else held[f]
            for c, child in children[node].items():
                depth[child] = depth[node] + 1
                if node:  # the root's children fall back to the root
                    g = f
                    while g and c not in children[g]:
                        g = fail[g]
                    fail[child] = children[g].get(c, 0)
                order.append(child)
        # Renumbered in that order, each node's children are consecutive, so one string of edge labels
        # holds the trie: node k's children are nodes first[k]+1 .. first[k+1], labelled
        # labels[first[k]:first[k+1]]. A dict per node would hold 4x the memory (2 MB instead of 0.5 MB
        # for 32 random stop strings of 256 characters) for the life of the request.
        new_id = {old: new for new, old in enumerate(order)}
        self._labels = "".join(c for old in order for c in children[old])
        self._first = list(itertools.accumulate((len(children[old]) for old in order), initial=0))
        self._starts = frozenset(children[0])
        self._fail = [new_id[fail[old]] for old in order]
        self._done = [done[old] for old in order]
        self.held = tuple(held[old] for old in order)

    def scan(self, state: int, delta: str, search: bool) -> tuple[int, tuple[str, int] | None]:
        """Advance state over delta -> (new state, None); with search, stop at the first completed stop
        string -> (state there, (stop string, how many characters of delta to keep))."""
        if not state and self._starts.isdisjoint(delta):
            return 0, None  # the common case: no character of delta can start a stop string
        labels, first, fail, done = self._labels, self._first, self._fail, self._done
        for i, c in enumerate(delta):
            while (j := labels.find(c, first[state], first[state + 1])) < 0 and state:
                state = fail[state]
            state = j + 1  # the child labelled c, or the root (j = -1)
            if search and (s := done[state]) is not None:
                return state, (s, i + 1 if self.include else i + 1 - len(s))
        return state, None


@functools.lru_cache(maxsize=8)
def _shared_stop_matcher(stop: tuple[str, ...], include_stop_str_in_output: bool) -> StopStringMatcher:
    """One matcher for the n samples of a request (built back to back): its tables are read-only."""
    return StopStringMatcher(stop, include_stop_str_in_output)


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
        decode = make_decode(tokenizer, params.skip_special_tokens)
        include = params.include_stop_str_in_output
        self._stop = _shared_stop_matcher(tuple(params.stop), include) if params.stop else None
        self._stop_state = 0  # the matcher's state after all of _text
        self._include_stop_token = include
        self._min_tokens = params.min_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and decode(context).endswith(_REPLACEMENT_CHAR):
            # A prompt that ends inside a character would swallow the output's first bytes: decode alone.
            context = []
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # an HF fast tokenizer's Rust side
        self._decoder = (
            _StreamDecoder(backend, decode, context, params.skip_special_tokens)
            if isinstance(backend, Tokenizer)
            else _WindowDecoder(decode, context)
        )
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
        delta = self._decoder.step(token_id)
        return self._advance(delta) if delta else ""

    def finish(self) -> str:
        """Flush once: decode incomplete bytes as the tokenizer would (U+FFFD), release held-back text."""
        if self._finished:
            return ""
        self._finished = True
        flushed = self._decoder.flush() if self.stop_reason is None else ""
        return (self._advance(flushed) if flushed else "") + self._emit(len(self._text))

    def _advance(self, delta: str) -> str:
        """Commit a decoded delta, apply stop strings, return what to emit."""
        start = len(self._text)
        self._text += delta
        if self._stop is None:
            return self._emit(len(self._text))
        self._stop_state, match = self._stop.scan(self._stop_state, delta, search=self.num_tokens > self._min_tokens)
        if match:
            self.stop_reason, keep = match
            self._text = self._text[: start + keep]
            return self._emit(len(self._text))
        held = 0 if self._finished else self._stop.held[self._stop_state]
        return self._emit(len(self._text) - held)

    def _emit(self, end: int) -> str:
        """Move output_text forward to _text[:end] and return the new part (held-back text never was in
        output_text, so a stop string never has to take back emitted text)."""
        delta = self._text[len(self.output_text) : max(end, len(self.output_text))]
        self.output_text += delta
        return delta
