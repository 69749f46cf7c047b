"""Block keys: a hash chain over full blocks of token ids, the identity used by the prefix cache.

A block's key commits to its parent's key, its own tokens and any extra keys (a tenant's cache salt), so
two blocks share a key only if the whole prefix up to and including them is identical. The hash is
sha256 over a canonical, length-prefixed byte encoding: stable across processes and machines (Python's
`hash()` is salted per process and far too weak to stand in for "same content" in a shared cache).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockKey = bytes

_DOMAIN = b"pagedkv-block-key-v1"
_LEN = struct.Struct("<Q")
_NO_PARENT = _DOMAIN + b"N"
_NO_EXTRA = b"L" + _LEN.pack(0)


def _encode(value: object, out: list[bytes]) -> None:
    """Append a type-tagged, length-prefixed encoding of `value`: distinct values never share bytes."""
    if value is None:
        out.append(b"N")
    elif isinstance(value, bool):
        out.append(b"T" if value else b"F")
    elif isinstance(value, int):
        digits = str(value).encode("ascii")
        out.extend((b"I", _LEN.pack(len(digits)), digits))
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out.extend((b"S", _LEN.pack(len(data)), data))
    elif isinstance(value, bytes):
        out.extend((b"B", _LEN.pack(len(value)), value))
    elif isinstance(value, (tuple, list)):
        out.extend((b"L", _LEN.pack(len(value))))
        for item in value:
            _encode(item, out)
    else:
        raise ValueError(
            f"extra_keys may only hold None, bool, int, str, bytes or tuples of those, got {type(value).__name__}"
        )


def hash_block(parent: BlockKey | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockKey:
    """Key of one block: sha256 over (parent key, the block's token ids, extra keys).

    The common case (a bytes parent or none, no extra keys) skips the generic encoder: this runs once per
    new full block of every request, on the engine's hot path. The bytes are the same either way.
    """
    n = len(token_ids)
    try:
        tokens = struct.pack(f"<{n}q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be int64 integers, got {list(token_ids)[:8]}...") from exc
    if parent is None:
        head = _NO_PARENT
    elif isinstance(parent, bytes):
        head = b"%sB%s%s" % (_DOMAIN, _LEN.pack(len(parent)), parent)
    else:
        raise ValueError(f"parent must be a block key (bytes) or None, got {type(parent).__name__}")
    if extra_keys:
        parts: list[bytes] = []
        _encode(tuple(extra_keys), parts)
        extra = b"".join(parts)
    else:
        extra = _NO_EXTRA
    return hashlib.sha256(b"%sK%s%s%s" % (head, _LEN.pack(n), tokens, extra)).digest()


def extend_block_keys(
    keys: list[BlockKey], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> None:
    """Append, in place, the keys of the full blocks of `token_ids` that `keys` does not cover yet.

    `keys` already holds the keys of the first `len(keys)` full blocks, so a request that grows one token at
    a time pays for each block once. `cache_salt` enters only the first block's extra keys; through the
    chain it changes every later key too, so requests with different salts never share a block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i in range(len(keys), len(token_ids) // block_size):
        parent = keys[i - 1] if i else None
        extra = (cache_salt,) if i == 0 and cache_salt is not None else ()
        keys.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
