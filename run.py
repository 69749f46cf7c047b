"""The pagedkv demo: a real model, chat requests sharing a long system prompt, cold cache vs warm cache.

    python run.py [--workload workloads/chat_shared_prefix.json] [--max-requests N] [engine options]

Round 1 starts with an empty prefix cache; round 2 sends the same requests again. The second round reuses
the cached blocks of every prompt, so it computes only each prompt's last partial block and its answers are
token-for-token the same (greedy).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from pagedkv import LLM, SamplingParams
from pagedkv.entrypoints.cli import add_engine_args, engine_kwargs

DEFAULT_WORKLOAD = Path(__file__).parent / "workloads" / "chat_shared_prefix.json"


def load_workload(path: Path, max_requests: int | None) -> tuple[list[list[dict[str, str]]], int]:
    data = json.loads(path.read_text())
    questions = data["questions"][:max_requests]
    conversations = [[{"role": "system", "content": data["system"]}, {"role": "user", "content": q}] for q in questions]
    return conversations, int(data.get("max_new_tokens", 64))


def run_round(llm: LLM, conversations, params: SamplingParams, name: str) -> list:
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    wall = time.perf_counter() - start
    after = llm.stats()
    queried = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    generated = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.metrics["ttft"] * 1000 for o in outputs]
    print(f"\n== {name} ==")
    print(f"  prefix-cache hit rate   {hits / max(queried, 1):6.1%}  ({hits} of {queried} prompt tokens reused)")
    print(f"  prompt tokens computed  {computed}")
    print(f"  TTFT mean / p50         {statistics.mean(ttfts):.0f} ms / {statistics.median(ttfts):.0f} ms")
    print(f"  throughput              {generated / wall:.1f} output tokens/s  ({generated} tokens in {wall:.2f} s)")
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--max-requests", type=int, default=None)
    add_engine_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    conversations, max_new_tokens = load_workload(args.workload, args.max_requests)
    print(f"pagedkv demo: {len(conversations)} chat requests sharing one system prompt ({args.workload.name})")
    load_start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    print(f"model loaded in {time.perf_counter() - load_start:.1f} s: {llm.engine.model_path}")
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)

    cold = run_round(llm, conversations, params, "round 1: cold cache")
    warm = run_round(llm, conversations, params, "round 2: warm cache")
    same = sum(a.token_ids == b.token_ids for a, b in zip(cold, warm))
    print(f"\ngreedy outputs identical across rounds: {same}/{len(cold)}")
    for conversation, output in list(zip(conversations, warm))[:3]:
        print(f"\nQ: {conversation[-1]['content']}\nA: {output.text.strip()}")


if __name__ == "__main__":
    main()
