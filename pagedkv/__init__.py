"""pagedkv: a small, readable, fast LLM inference engine on a paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]

if TYPE_CHECKING:
    from pagedkv.config import EngineConfig
    from pagedkv.engine.request import RequestOutput
    from pagedkv.entrypoints.llm import LLM
    from pagedkv.sampling import SamplingParams


def __getattr__(name: str):
    # Imported lazily so that `import pagedkv.kv.ops` does not pull in transformers.
    if name == "LLM":
        from pagedkv.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedkv.sampling import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from pagedkv.engine.request import RequestOutput

        return RequestOutput
    if name == "EngineConfig":
        from pagedkv.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
