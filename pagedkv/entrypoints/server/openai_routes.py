"""The OpenAI API's routes (/v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings) and the service
routes vLLM's server has beside them (/health, /metrics): each body read by the server's bounded parser, then
handed to its serving module."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from pagedkv.entrypoints.server.openai_objects import ModelCard, ModelList
from pagedkv.entrypoints.server.openai_requests import ChatCompletionRequest, CompletionRequest
from pagedkv.entrypoints.server.serving import ServingContext
from pagedkv.entrypoints.server.serving_chat import create_chat_completion
from pagedkv.entrypoints.server.serving_completions import create_completion
from pagedkv.entrypoints.server.serving_embeddings import EmbeddingRequest, create_embedding

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.entrypoints.server.bodies import BodyParser


def add_openai_routes(app: FastAPI, ctx: ServingContext, bodies: BodyParser, engine: LLMEngine) -> None:
    """Register the OpenAI routes and /health, /metrics on ``app`` (before the engine thread starts: it reads the
    engine)."""
    max_model_len, hidden_size = engine.max_model_len, engine.runner.model.spec.hidden_size

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if ctx.engine.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = ctx.engine.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=ctx.model_name, root=ctx.model_name, max_model_len=max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, await bodies.parse(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, await bodies.parse(request, ChatCompletionRequest), request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await create_embedding(ctx, await bodies.parse(request, EmbeddingRequest), request, hidden_size)
