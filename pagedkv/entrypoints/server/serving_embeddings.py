"""POST /v1/embeddings: OpenAI's embeddings API over the engine's pooling (``pagedkv.engine.pooling``).

Each input is one engine request that prefills its prompt and samples nothing: batched with the generation
traffic by the same scheduler, bounded by the same limits, and served from the same prefix cache. The vector
is the final hidden states pooled at the last token (pagedkv's ``pooling: "mean"`` extension averages every
position), L2-normalised. ``encoding_format: "base64"`` (what the ``openai`` package asks for unless told
otherwise) is the float32 vector's little-endian bytes, base64-encoded; ``dimensions`` is accepted only as the
model's own width: pagedkv does not shorten embeddings, and a shorter vector that was not trained for it
would be a plausible wrong answer.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, field_validator
from starlette.requests import Request
from starlette.responses import Response

from pagedkv.engine.prompts import EnginePrompt
from pagedkv.entrypoints.server.protocol import APIError, prompt_shape
from pagedkv.entrypoints.server.serving import ServingContext, collect
from pagedkv.entrypoints.server.serving_completions import completion_prompts
from pagedkv.sampling_params import POOLING_METHODS, SamplingParams


class EmbeddingRequest(BaseModel):
    """OpenAI's fields, plus ``pooling``; any other field is refused (``extra="forbid"``), by name."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    pooling: Literal[POOLING_METHODS] = "last"  # type: ignore[valid-type]

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: object) -> object:
        return prompt_shape(value, "input")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


async def create_embedding(ctx: ServingContext, body: EmbeddingRequest, request: Request, width: int) -> Response:
    """Embed every input; ``width`` is the model's hidden size (the only ``dimensions`` there is)."""
    ctx.check_model(body.model)
    if body.dimensions is not None and body.dimensions != width:
        raise APIError(
            400,
            f"dimensions={body.dimensions} is not supported: this model's embeddings have {width} dimensions "
            "and pagedkv does not shorten them; leave dimensions out",
            param="dimensions",
            code="unsupported_parameter",
        )
    vectors, prompt_tokens = await embed(ctx, completion_prompts(body.input), body.pooling, request)
    data = [Embedding(index=i, embedding=_encoded(v, body.encoding_format)) for i, v in enumerate(vectors)]
    usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    response = EmbeddingResponse(data=data, model=ctx.model_name, usage=usage)
    return Response(response.model_dump_json(), media_type="application/json")


async def embed(
    ctx: ServingContext, prompts: list[EnginePrompt], pooling: str, request: Request
) -> tuple[list[list[float]], int]:
    """Every prompt's embedding, in order, and the prompt tokens they took: what /v1/embeddings and Ollama's
    /api/embed share (at most ``--max-prompts`` inputs, each one engine request with the server's bounds)."""
    if len(prompts) > ctx.limits.max_prompts:
        raise APIError(400, f"{len(prompts)} inputs, at most {ctx.limits.max_prompts}", param="input")
    params = SamplingParams(max_tokens=0, pooling=pooling)
    stream = await ctx.start("embd", prompts, params, None, "input", stream=False)
    outputs = await collect(stream, request)
    if any(o.embedding is None for o in outputs):  # the engine stopped an input alone (its error is logged)
        raise APIError(500, "computing an embedding failed", type="internal_error")
    return [o.embedding for o in outputs], stream.prompt_tokens


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()  # float32, little-endian
