"""What tensor parallelism costs on this machine: the collectives by size, and TP=3 vs TP=1 end to end.

    python benchmarks/tensor_parallel.py [--size 3] [--requests 8] [--max-new-tokens 32] [--quick] [--json]
                                         [--model PATH]

1. Collectives, timed on ``--size`` spawned ranks over gloo on 127.0.0.1 (median of many calls, rank 0's
   clock): the all-reduce after o_proj / down_proj at the model's hidden size (the default model's: 576) for
   1..2048 rows, the logits gather of a vocabulary slice, and a step's broadcast (header + payload).
   A step makes 2 all-reduces per layer + the embedding's (the default model's 30 layers: 61) and one gather.
2. End to end: the workload's chat questions, greedy, TP=``--size`` (and its exact mode) vs TP=1 in one
   run, the same number of threads in total; output tokens/s, and whether tokens (and, for the exact mode,
   logprobs) are equal.

``--model`` (default: the default model, SmolLM2-135M-Instruct, whose 9 heads split 3 ways, not 2) takes any
model pagedkv loads whose heads ``--size`` divides; the test suite smoke-runs this script on a tiny one.

On a 2-core machine TP cannot be faster: the point is what it costs, so you know what a real multi-socket
or multi-machine split has to win back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.step_inputs import StepInputs  # noqa: E402
from pagedkv.model.loader import model_directory  # noqa: E402
from pagedkv.parallel import wire  # noqa: E402
from pagedkv.parallel.group import join_group, leave_group  # noqa: E402
from pagedkv.parallel.workers import _free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _median_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _time_collectives(rank: int, world: int, init_method: str, repeats: int, hidden: int, vocab: int, results) -> None:
    torch.set_num_threads(1)
    tp = join_group(rank, world, init_method)
    rows = {}
    try:
        for n in (1, 8, 32, 256, 2048):
            x = torch.randn(n, hidden)
            rows[f"all_reduce [{n}, {hidden}]"] = _median_us(lambda x=x: tp.all_reduce(x), repeats)
        for n in (1, 32):
            local = torch.randn(n, vocab // world)
            rows[f"gather logits [{n}, {vocab // world}] x {world}"] = _median_us(
                lambda local=local: tp.gather_logits(local, vocab), repeats
            )
        step = StepInputs(list(range(32)), list(range(32)), [[i] for i in range(32)], [1] * 32, [9] * 32,
                          list(range(32)), [], [])  # fmt: skip
        if tp.is_driver:
            rows["step broadcast (32 decodes)"] = _median_us(lambda: wire.send_lists(tp, step.to_wire()), repeats)
            wire.send_stop(tp)
        else:
            while wire.receive_lists(tp) is not None:
                pass
        results.put((rank, rows))
    finally:
        leave_group()


def collectives(world: int, repeats: int, hidden: int, vocab: int) -> dict[str, float]:
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        context.Process(target=_time_collectives, args=(r, world, init_method, repeats, hidden, vocab, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join(30)
    return out[0]


def end_to_end(model: str | None, size: int, conversations: list, max_new_tokens: int, threads: int) -> dict:
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0, logprobs=0)
    runs = {}
    for name, tp, exact in (("tp1", 1, False), (f"tp{size}", size, False), (f"tp{size}_exact", size, True)):
        llm = LLM(
            model=model,
            tensor_parallel_size=tp,
            tensor_parallel_exact=exact,
            num_threads=max(1, threads // tp),
            num_kv_blocks=512,
        )
        llm.chat(conversations[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        runs[name] = {"tok_s": tokens / wall, "outputs": [(o.token_ids, o.outputs[0].logprobs) for o in outputs]}
        llm.engine.close()
    one = runs["tp1"]
    tokens = [[ids for ids, _ in run["outputs"]] for run in runs.values()]
    return {
        "tok_s": {name: round(run["tok_s"], 1) for name, run in runs.items()},
        "vs_tp1": {name: round(run["tok_s"] / one["tok_s"], 3) for name, run in runs.items()},
        "greedy_tokens_equal": all(
            [i for i, _ in run["outputs"]] == [i for i, _ in one["outputs"]] for run in runs.values()
        ),
        "exact_bitwise_equal": runs[f"tp{size}_exact"]["outputs"] == one["outputs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: the default model)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="threads in total, shared by the ranks")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 2 requests, 8 tokens")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.requests, args.max_new_tokens = 20, 2, 8
    log = sys.stderr if args.json else sys.stdout
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    cpu += " (AVX-512)" if any("avx512f" in line for line in lines) else " (AVX2)"
    print(f"CPU: {cpu}, {os.cpu_count()} cores; {args.size} ranks, gloo on 127.0.0.1", file=log)
    config = json.loads((model_directory(args.model) / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    timings = collectives(args.size, args.repeats, hidden, vocab)
    print(format_table(["collective", "median us"], [[k, v] for k, v in timings.items()]), file=log)
    all_reduces = 2 * config["num_hidden_layers"] + 1
    per_step = (
        all_reduces * timings[f"all_reduce [1, {hidden}]"]
        + timings[f"gather logits [1, {vocab // args.size}] x {args.size}"]
    )
    print(f"a one-row decode step's collectives: ~{per_step / 1000:.1f} ms", file=log)
    data = json.loads((ROOT / "workloads" / "chat_shared_prefix.json").read_text())
    conversations = [
        [{"role": "system", "content": data["system"]}, {"role": "user", "content": q}]
        for q in data["questions"][: args.requests]
    ]
    e2e = end_to_end(args.model, args.size, conversations, args.max_new_tokens, args.threads)
    print(
        f"end to end, {args.requests} chats x {args.max_new_tokens} tokens: tok/s {e2e['tok_s']}, vs TP=1 "
        f"{e2e['vs_tp1']}; greedy tokens equal: {e2e['greedy_tokens_equal']}; exact mode bitwise equal to TP=1: "
        f"{e2e['exact_bitwise_equal']}",
        file=log,
    )
    summary = {"cpu": cpu, "size": args.size, "collectives_us": timings, "one_row_step_collectives_ms": per_step / 1000}
    if args.json:
        print(json.dumps(summary | {"end_to_end": e2e}, indent=2))


if __name__ == "__main__":
    main()
