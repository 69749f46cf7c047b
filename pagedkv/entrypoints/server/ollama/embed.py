"""Ollama's embedding routes over the engine's pooling: /api/embed and the older /api/embeddings.

Both pool the last token's final hidden states and L2-normalise them, as /v1/embeddings does by default
(``pagedkv.engine.pooling``); Ollama's older route returns its vectors unnormalised, ours are normalised on
both routes (the docs say so). An embedding samples nothing, so ``options`` has nothing to set: any option
is a 400 naming it. Ollama cuts an input longer than the context unless told ``truncate: false``; pagedkv
never cuts a prompt silently, so ``truncate: true`` is refused and a prompt longer than the context is a
400, as on every route. ``dimensions`` is accepted only as the model's own width.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse

from pagedkv.engine.prompts import EnginePrompt
from pagedkv.entrypoints.server.ollama.protocol import refuse_unknown
from pagedkv.entrypoints.server.ollama.serving import NS, check_model
from pagedkv.entrypoints.server.protocol import APIError
from pagedkv.entrypoints.server.serving import ServingContext
from pagedkv.entrypoints.server.serving_embeddings import embed


class _OllamaEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None  # accepted and ignored: the model is always loaded

    def check_supported(self) -> None:
        refuse_unknown(self, "")
        for name in self.options or {}:
            raise APIError(400, f"options.{name[:100]} is not used by an embedding: remove it", param="options")


class OllamaEmbedRequest(_OllamaEmbeddingRequest):
    input: str | list[str]
    truncate: StrictBool | None = None
    dimensions: StrictInt | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return value
        raise ValueError("input must be a string or a list of strings")


class OllamaEmbeddingsRequest(_OllamaEmbeddingRequest):
    prompt: str


async def ollama_embed(ctx: ServingContext, body: OllamaEmbedRequest, request: Request, width: int) -> JSONResponse:
    """/api/embed: ``{"embeddings": [...], "prompt_eval_count", durations}`` for one input or several."""
    started = time.perf_counter()
    body.check_supported()
    check_model(ctx, body.model)
    if body.truncate:
        raise APIError(400, "truncate: true is not supported: pagedkv never cuts a prompt; send truncate: false")
    if body.dimensions is not None and body.dimensions != width:
        raise APIError(400, f"dimensions={body.dimensions}: this model's embeddings have {width}", param="dimensions")
    inputs = [body.input] if isinstance(body.input, str) else body.input
    if not inputs or not all(inputs):
        raise APIError(400, "input is empty: give a non-empty string or a list of them", param="input")
    vectors, prompt_tokens = await embed(ctx, [EnginePrompt(prompt=text) for text in inputs], "last", request)
    elapsed = int((time.perf_counter() - started) * NS)
    return JSONResponse(
        {
            "model": body.model,
            "embeddings": vectors,
            "total_duration": elapsed,
            "load_duration": 0,  # the model is always loaded
            "prompt_eval_count": prompt_tokens,
        }
    )


async def ollama_embeddings(ctx: ServingContext, body: OllamaEmbeddingsRequest, request: Request) -> JSONResponse:
    """/api/embeddings (Ollama's older route): one prompt, ``{"embedding": [...]}``."""
    body.check_supported()
    check_model(ctx, body.model)
    if not body.prompt:
        raise APIError(400, "prompt is empty: give the text to embed", param="prompt")
    vectors, _ = await embed(ctx, [EnginePrompt(prompt=body.prompt)], "last", request)
    return JSONResponse({"embedding": vectors[0]})
