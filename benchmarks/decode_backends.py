"""End-to-end decode throughput of the two attention backends on the default model.

    python benchmarks/decode_backends.py [--requests 8] [--prompt-tokens 2000] [--max-tokens 64] [--json]

Each backend gets a fresh engine and the same long prompts (distinct, so nothing is shared). Decode
throughput counts the tokens after each request's first one, over the time from the last first token to
the end, so the prefill is left out; it is reported on its own (``prefill_s``: start to the last first token;
the kernel backend prefills on the kernel too, the gather one on SDPA). Greedy outputs must be identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagedkv import LLM, SamplingParams

TOPICS = ["rivers", "mountains", "libraries", "trains", "gardens", "bridges", "markets", "lighthouses"]


def long_prompts(llm: LLM, count: int, prompt_tokens: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        sentence = f"Note {i}: this paragraph is about {topic}, their history and the people who care for them. "
        text = sentence * (prompt_tokens // 16)
        messages = [{"role": "user", "content": text + f"Summarise the notes about {topic} in one sentence."}]
        prompts.append(llm.engine.apply_chat_template(messages)[-prompt_tokens:])
    return prompts


def run(backend: str, args: argparse.Namespace) -> dict:
    llm = LLM(attention_backend=backend, enable_prefix_caching=False, num_threads=args.threads)
    prompts = long_prompts(llm, args.requests, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompts[0][:32]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    end = time.perf_counter()
    decode_start = max(start + o.metrics["ttft"] for o in outputs)
    decode_tokens = sum(len(o.token_ids) - 1 for o in outputs)
    return {
        "backend": llm.engine.attention.name,
        "prompt_tokens": sum(len(p) for p in prompts),
        "wall_s": round(end - start, 2),
        "prefill_s": round(decode_start - start, 2),
        "decode_tok_s": round(decode_tokens / (end - decode_start), 1),
        "outputs": [o.token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    kernel, gather = run("kernel", args), run("gather", args)
    summary = {
        "kernel": {k: v for k, v in kernel.items() if k != "outputs"},
        "gather": {k: v for k, v in gather.items() if k != "outputs"},
        "decode_speedup": round(kernel["decode_tok_s"] / gather["decode_tok_s"], 2),
        "outputs_identical": kernel["outputs"] == gather["outputs"],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    for name in ("kernel", "gather"):
        row = summary[name]
        print(
            f"{name:>7}: decode {row['decode_tok_s']:7.1f} tok/s   prefill {row['prefill_s']:6.2f} s   "
            f"wall {row['wall_s']:6.2f} s   ({row['backend']})"
        )
    print(
        f"kernel / gather decode throughput: {summary['decode_speedup']}x; "
        f"greedy outputs identical: {summary['outputs_identical']}"
    )
    sys.exit(0 if summary["outputs_identical"] else 1)


if __name__ == "__main__":
    main()
