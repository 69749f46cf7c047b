"""What structured outputs cost: the chat workload answered as JSON under a schema vs unconstrained.

    python benchmarks/structured.py [--max-requests N] [--max-new-tokens N] [--rounds R] [--quick] [--json]

One engine runs the same batch (greedy, the default model) both ways, alternating, ``--rounds`` times each;
the best round of each is reported. The grammar's own time is measured inside the engine: the masks of a
step are computed on the grammar thread while the model runs (``compute``), and the engine thread waits
only for what is not done when the logits are (``wait``), then applies them (``apply``). Every constrained
answer that finished is checked to parse and validate (jsonschema).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, write_json  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.engine import core  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 300},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "topics": {"type": "array", "items": {"enum": ["hours", "loans", "fees", "events", "other"]}, "maxItems": 3},
    },
    "required": ["answer", "confidence", "topics"],
    "additionalProperties": False,
}


class GrammarClock:
    """Per-step grammar time in one engine: computing a step's masks (grammar thread), waiting for them after
    the model step (engine thread), applying them to the logits (engine thread)."""

    def __init__(self, engine_core: core.EngineCore) -> None:
        self.times: dict[str, list[float]] = {"compute": [], "wait": [], "apply": []}
        compute, apply, pool = engine_core._grammar_masks, core._apply_grammar_masks, engine_core._mask_thread
        clock = self

        class TimedFuture:
            def __init__(self, future) -> None:
                self.future = future

            def result(self):
                return clock.timed("wait", self.future.result)

        class TimedPool:
            def submit(self, fn, *args):
                return TimedFuture(pool.submit(fn, *args))

        engine_core._grammar_masks = lambda step: self.timed("compute", compute, step)
        engine_core._mask_thread = TimedPool()
        core._apply_grammar_masks = lambda *args: self.timed("apply", apply, *args)

    def timed(self, name: str, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.times[name].append(time.perf_counter() - start)

    def clear(self) -> None:
        for values in self.times.values():
            values.clear()

    def per_step_ms(self) -> dict[str, float]:
        steps = max(len(self.times["compute"]), 1)
        return {name: 1000 * sum(values) / steps for name, values in self.times.items()} | {
            "steps": len(self.times["compute"])
        }


def run_batch(llm: LLM, conversations: list, params: SamplingParams) -> tuple[float, list]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, default=ROOT / "workloads" / "chat_shared_prefix.json")
    parser.add_argument("--max-requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4 requests, 24 tokens, one round")
    parser.add_argument("--json", action="store_true", help="print the JSON summary to stdout")
    parser.add_argument("--out-json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.max_requests, args.max_new_tokens, args.rounds = 4, 24, 1
    torch.set_num_threads(args.threads)
    data = json.loads(args.workload.read_text())
    instruction = " Answer as JSON with your answer, your confidence (0-100) and the topics it touches."
    conversations = [
        [{"role": "system", "content": data["system"]}, {"role": "user", "content": q + instruction}]
        for q in data["questions"][: args.max_requests]
    ]
    log = sys.stderr if args.json else sys.stdout
    llm = LLM(num_threads=args.threads)
    clock = GrammarClock(llm.engine.core)
    kinds = {
        "unconstrained": SamplingParams(max_tokens=args.max_new_tokens, temperature=0),
        "json_schema": SamplingParams(
            max_tokens=args.max_new_tokens, temperature=0, structured_outputs={"json": ANSWER}
        ),
    }
    run_batch(llm, conversations[:2], kinds["json_schema"])  # compile the schema and warm up
    best: dict[str, tuple[float, list]] = {}
    grammar_ms: dict[str, float] = {}
    for round_ in range(args.rounds):
        for name, params in kinds.items():
            clock.clear()
            wall, outputs = run_batch(llm, conversations, params)
            tokens = sum(len(o.token_ids) for o in outputs)
            print(f"round {round_ + 1}: {name:13s} {tokens / wall:6.1f} tok/s ({tokens} tokens)", file=log)
            if name not in best or tokens / wall > sum(len(o.token_ids) for o in best[name][1]) / best[name][0]:
                best[name] = (wall, outputs)
                if name == "json_schema":
                    grammar_ms = clock.per_step_ms()
    valid = finished = 0
    for output in best["json_schema"][1]:
        if output.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(output.text), ANSWER)
            valid += 1
    rates = {name: sum(len(o.token_ids) for o in outs) / wall for name, (wall, outs) in best.items()}
    summary = {
        "benchmark": "structured",
        "requests": len(conversations),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "json_schema_vs_unconstrained": round(rates["json_schema"] / rates["unconstrained"], 3),
        "grammar_ms_per_step": {k: round(v, 3) for k, v in grammar_ms.items()},
        "finished_valid": f"{valid}/{finished} (of {len(conversations)}; the rest hit max_tokens)",
        "quick": args.quick,
    }
    rows = [[name, f"{rate:.1f}"] for name, rate in rates.items()]
    print(format_table(["batch", "output tok/s"], rows), file=log)
    print(
        f"json_schema / unconstrained: {summary['json_schema_vs_unconstrained']:.2f}; grammar per step: "
        f"{summary['grammar_ms_per_step']}; valid: {summary['finished_valid']}",
        file=log,
    )
    if args.out_json:
        write_json(summary, args.out_json)
    if args.json:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
