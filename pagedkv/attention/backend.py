"""Choosing and calling the decode attention backend: the compiled kernel or the gather + SDPA fallback.

The choice is made once, when the engine starts, so a machine without a compiler still runs (on the
fallback, with one log line saying why) instead of failing on its first decode step. Both backends give
the same numbers; the kernel is faster because it reads K/V in place instead of gathering a copy.
"""

from __future__ import annotations

from torch import Tensor

from pagedkv import extension
from pagedkv.attention.kernel import decode_attention_kernel, decode_attention_reference, kernel_available

BACKENDS = ("kernel", "gather")
ENV_VAR = "PAGEDKV_ATTENTION_BACKEND"

_DECODE = {"kernel": decode_attention_kernel, "gather": decode_attention_reference}


def resolve_backend(requested: str | None) -> str:
    """``"kernel"`` or ``"gather"``: the argument, else ``$PAGEDKV_ATTENTION_BACKEND``, else the kernel if
    it builds (else ``"gather"``, with one log line saying why).

    Asking for the kernel where it cannot be built falls back to ``"gather"`` with a warning.
    """
    return extension.choose_backend(requested, ENV_VAR, BACKENDS, kernel_available, "attention backend")


def decode_attention(
    backend: str,
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """Decode attention ``[B, Hq, D]`` by ``backend``; the arguments are ``decode_attention_kernel``'s."""
    try:
        decode = _DECODE[backend]
    except KeyError:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}") from None
    return decode(q, k_pool, v_pool, block_tables, seq_lens, scale)
