"""`pagedkv chat`: an interactive conversation that streams each answer as it is generated.

Every turn resends the whole conversation; the prefix cache makes that cheap, since all earlier turns are
already in the pool -- only the new message is computed.
"""

from __future__ import annotations

import sys
import time

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.sampling_params import SamplingParams


def interactive_chat(engine_options: dict, params: SamplingParams, system: str | None) -> int:
    engine = LLMEngine(EngineConfig(**engine_options))
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print("pagedkv chat -- empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        start = time.perf_counter()
        try:
            request_id = engine.add_request(prompt_token_ids=engine.apply_chat_template(messages), params=params)
        except ValueError as exc:  # the conversation outgrew the context, say: the session goes on without it
            print(f"[{exc}]", file=sys.stderr)
            messages.pop()
            continue
        answer, cached = "", 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id:
                    sys.stdout.write(output.outputs[0].delta_text)
                    sys.stdout.flush()
                    answer, cached = output.text, output.num_cached_tokens
        elapsed = time.perf_counter() - start
        print(f"\n[{elapsed:.2f} s, {cached} prompt tokens from the prefix cache]", file=sys.stderr)
        messages.append({"role": "assistant", "content": answer})
    return 0
