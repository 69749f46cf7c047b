"""pagedkv: a small, readable, fast LLM inference engine on a paged KV cache."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]

if TYPE_CHECKING:
    from pagedkv.config import EngineConfig
    from pagedkv.engine.request import RequestOutput
    from pagedkv.entrypoints.llm import LLM
    from pagedkv.sampling_params import SamplingParams


# Imported lazily so that `import pagedkv.kv.ops` does not pull in transformers: name -> its module.
_LAZY = {
    "LLM": "pagedkv.entrypoints.llm",
    "SamplingParams": "pagedkv.sampling_params",
    "RequestOutput": "pagedkv.engine.request",
    "EngineConfig": "pagedkv.config",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
