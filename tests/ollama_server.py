"""What the Ollama API tests share: the served model's name and key, the prompts, a tool, the server's limits,
and the engine's offline greedy output as the reference (computed before a server takes the engine over)."""

from __future__ import annotations

from fastapi import FastAPI

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_server import build_app
from pagedkv.sampling_params import SamplingParams

MODEL, KEY, MAX_QUEUED, MAX_BODY, MAX_TOKENS, CONTEXT = "smol", "ollama-key", 2, 64 * 1024, 8, 512
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
VICTIM = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
VICTIM_TOKENS = 48
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def new_engine() -> LLMEngine:
    """The default model with a small context; one torch thread, as the server's own threads share the cores."""
    return LLMEngine(EngineConfig(num_kv_blocks=512, max_model_len=CONTEXT, num_threads=1))


def ollama_app(engine: LLMEngine) -> FastAPI:
    """The server's app with an API key, a small body limit and room for two sequences in the queue."""
    limits = ServerLimits(max_queued_seqs=MAX_QUEUED)
    return build_app(engine, MODEL, api_key=KEY, max_body_bytes=MAX_BODY, limits=limits)


def run_offline(engine: LLMEngine, token_ids: list[int], max_tokens: int):
    request_id = engine.add_request(
        prompt_token_ids=token_ids, params=SamplingParams(max_tokens=max_tokens, temperature=0)
    )
    done = None
    while engine.has_unfinished_requests():
        done = next((o for o in engine.step() if o.finished and o.request_id == request_id), done)
    return done
