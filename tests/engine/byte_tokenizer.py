"""A tokenizer small enough to reason about: each token id stands for a fixed run of UTF-8 bytes.

Tokens may end in the middle of a character (like a byte-level BPE's), so text can only be printed once a
character completes; ids listed in ``SPECIAL`` are special tokens (left out with skip_special_tokens). It has
only ``decode``, so the output processor decodes through its own window (``detokenizer._WindowDecoder``).
"""

from __future__ import annotations

SPECIAL = {0: "<eos>"}


class ByteTokenizer:
    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces

    @classmethod
    def of_texts(cls, *texts: str) -> tuple[ByteTokenizer, list[list[int]]]:
        """A tokenizer with one token per character's bytes split in two where it has several, and the ids
        of each text under it (ids start at 1; 0 is the special ``<eos>``)."""
        pieces: dict[bytes, int] = {}
        encoded = []
        for text in texts:
            ids = []
            for char in text:
                raw = char.encode()
                for part in (raw,) if len(raw) == 1 else (raw[:1], raw[1:]):
                    ids.append(pieces.setdefault(part, len(pieces) + 1))
            encoded.append(ids)
        return cls({i: b for b, i in pieces.items()}), encoded

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Bytes joined and decoded as a byte-level tokenizer does: an incomplete character becomes U+FFFD."""
        out = b""
        for i in ids:
            if i in SPECIAL:
                out += b"" if skip_special_tokens else SPECIAL[i].encode()
            else:
                out += self.pieces[i]
        return out.decode("utf-8", errors="replace")
