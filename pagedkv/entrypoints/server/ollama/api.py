"""Ollama's API on the OpenAI server's app: /api/chat, /api/generate, and the model routes clients ask first.

The routes live on the same app as /v1/*, so every one passes the same ``RequestGate`` (Host check, API key
as ``Authorization: Bearer``, body size) and ``BodyParser`` (value, depth and list bounds) before any work,
and generation shares the queue limit, the fair seats and disconnect handling (``ollama.serving``).

pagedkv serves one model, loaded at start-up and kept until the server stops: /api/tags and /api/ps list
it, ``keep_alive`` changes nothing, and the routes that manage models (pull, create, copy, delete, push)
are answered with a 404 that lists the routes this server has. /api/embed and /api/embeddings embed with the
engine's pooling (``ollama.embed``).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.entrypoints.server.ollama.embed import (
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    ollama_embed,
    ollama_embeddings,
)
from pagedkv.entrypoints.server.ollama.protocol import (
    OLLAMA_DEFAULTS,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    is_ollama_path,
)
from pagedkv.entrypoints.server.ollama.serving import check_model, create_ollama_response, rfc3339
from pagedkv.entrypoints.server.protocol import APIError
from pagedkv.entrypoints.server.serving import ServingContext
from pagedkv.model.gguf_file import GGUFFile, split_files

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.entrypoints.server.bodies import BodyParser

# The Ollama release whose API these routes follow (docs.ollama.com/api, /api/version's example).
OLLAMA_API_VERSION = "0.12.6"
# /api/ps: the model never unloads (Ollama reports a far-future time for keep_alive < 0 too).
NEVER_EXPIRES = "9999-12-31T23:59:59Z"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What Ollama's model routes report about the served model, read once from its files and config."""

    name: str
    size: int  # bytes of the model's files
    digest: str
    modified_at: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    template: str
    context_length: int

    def listing(self) -> dict[str, Any]:
        """The model as /api/tags and /api/ps list it."""
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details,
        }

    def shown(self) -> dict[str, Any]:
        """The model as /api/show describes it."""
        return {
            "modelfile": "",
            "parameters": "\n".join(f"{k} {v}" for k, v in OLLAMA_DEFAULTS.items()),
            "template": self.template,  # the model's Jinja chat template (Ollama's own are Go templates)
            "details": self.details,
            "model_info": self.model_info,
            # tools: in the template's format or the generic one; embedding: /api/embed pools the hidden states
            "capabilities": ["completion", "tools", "embedding"],
            "modified_at": self.modified_at,
        }


def model_facts(engine: LLMEngine, name: str) -> ModelFacts:
    path = Path(str(engine.model_path))
    gguf = path.is_file()  # a GGUF file (the loader reads a directory as a Hugging Face checkpoint)
    files = split_files(path) if gguf else sorted(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    modified = max((f.stat().st_mtime for f in files), default=0.0)
    # Identifies the loaded version without reading gigabytes: the files' names, sizes and times.
    digest = hashlib.sha256(repr([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode())
    parameters, weight_type = _weights_summary(files, gguf)
    config = engine.hf_config
    family = str(config.model_type)
    details = {
        "parent_model": "",
        "format": "gguf" if gguf else "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": _human_count(parameters),
        "quantization_level": weight_type,  # of the file; pagedkv may run it in another (weight_format)
    }
    info = {
        "general.architecture": family,
        "general.parameter_count": parameters,
        f"{family}.context_length": engine.max_model_len,  # the server's context, which num_ctx may not exceed
        f"{family}.embedding_length": config.hidden_size,
        f"{family}.block_count": config.num_hidden_layers,
        f"{family}.attention.head_count": config.num_attention_heads,
        f"{family}.attention.head_count_kv": getattr(config, "num_key_value_heads", config.num_attention_heads),
        f"{family}.vocab_size": config.vocab_size,
    }
    return ModelFacts(
        name=name,
        size=size,
        digest=digest.hexdigest(),
        modified_at=rfc3339(modified),
        details=details,
        model_info=info,
        template=getattr(engine.tokenizer, "chat_template", None) or "",
        context_length=engine.max_model_len,
    )


def _weights_summary(files: list[Path], gguf: bool) -> tuple[int, str]:
    """(parameter count, the most common type of the weight matrices), from the files' headers only."""
    shapes_and_types: list[tuple[tuple[int, ...], str]] = []
    if gguf:
        tensors = GGUFFile(files[0]).tensors.values()  # all parts' tensors
        shapes_and_types = [(t.shape, t.type_name) for t in tensors]
    else:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 -- safetensors 0.8's safe_open is not iterable
                    piece = f.get_slice(key)
                    shapes_and_types.append((tuple(piece.get_shape()), piece.get_dtype()))
    parameters = sum(math.prod(shape) for shape, _ in shapes_and_types)
    matrices = Counter(kind for shape, kind in shapes_and_types if len(shape) == 2)
    return parameters, (matrices.most_common(1)[0][0] if matrices else "")


def _human_count(count: int) -> str:
    """Ollama's parameter_size: ``134.52M``, ``8.0B`` (empty when the files hold no tensors we can read)."""
    if count == 0:
        return ""
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def add_ollama_routes(app: FastAPI, ctx: ServingContext, bodies: BodyParser, engine: LLMEngine) -> None:
    """Register Ollama's routes on ``app`` (call before the engine thread starts: it reads the engine)."""
    facts = model_facts(engine, ctx.model_name)
    max_model_len = engine.max_model_len

    @app.post("/api/chat")
    async def ollama_chat(request: Request) -> Response:
        body = await bodies.parse(request, OllamaChatRequest)
        return await create_ollama_response(ctx, body, request, max_model_len)

    @app.post("/api/generate")
    async def ollama_generate(request: Request) -> Response:
        body = await bodies.parse(request, OllamaGenerateRequest)
        return await create_ollama_response(ctx, body, request, max_model_len)

    @app.get("/api/tags")
    async def ollama_tags() -> JSONResponse:
        return JSONResponse({"models": [facts.listing()]})

    @app.get("/api/ps")
    async def ollama_ps() -> JSONResponse:
        running = facts.listing() | {
            "expires_at": NEVER_EXPIRES,
            "size_vram": 0,  # weights and KV cache live in host memory
            "context_length": facts.context_length,
        }
        return JSONResponse({"models": [running]})

    @app.post("/api/show")
    async def ollama_show(request: Request) -> JSONResponse:
        body = await bodies.parse(request, OllamaShowRequest)
        check_model(ctx, body.model)
        return JSONResponse(facts.shown())

    @app.get("/api/version")
    async def ollama_version() -> JSONResponse:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    @app.post("/api/embed")
    async def ollama_embed_route(request: Request) -> Response:
        body = await bodies.parse(request, OllamaEmbedRequest)
        return await ollama_embed(ctx, body, request, engine.runner.model.spec.hidden_size)

    @app.post("/api/embeddings")
    async def ollama_embeddings_route(request: Request) -> Response:
        body = await bodies.parse(request, OllamaEmbeddingsRequest)
        return await ollama_embeddings(ctx, body, request)

    served = ", ".join(r.path for r in app.routes if is_ollama_path(r.path))  # the routes above

    @app.api_route("/api/{route:path}", methods=["GET", "POST", "PUT", "DELETE", "HEAD"])
    async def ollama_unknown(request: Request, route: str) -> Response:
        raise APIError(404, f"{request.method} /api/{route[:100]} is not served here; pagedkv serves {served}")
