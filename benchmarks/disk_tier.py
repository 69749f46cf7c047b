"""The prefix cache's disk tier across a restart: what a restarted engine computes, its first TTFT, and the
cost of loading and writing blocks.

    python benchmarks/disk_tier.py [--repeats 3] [--threads 2] [--json]

Every phase is its own process (a real restart; the model loads each time), on the default model and
``workloads/chat_shared_prefix.json`` (32 chat requests sharing a system prompt, greedy):

- ``round`` without kv_cache_dir, then with an empty one (it writes every block): round 1 cold, round 2 warm
  in memory. Their difference in wall time is what writing costs end to end.
- ``round`` again with the directory: a restarted engine's first round, from disk.
- ``first``: one request alone, the first of a fresh engine (and, again, after one unrelated warm-up
  request) -- cold (no directory) vs restarted (the directory): the workload's first question (all its full
  blocks are on disk), and questions the workload does not ask (only the system prompt is on disk; another
  question each time), alternating, ``--repeats`` times each.

Every restarted answer is checked to be token for token, logprob for logprob, the cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pagedkv.kv.block_directory import BLOCKS_DIR  # noqa: E402

WORKLOAD = ROOT / "workloads" / "chat_shared_prefix.json"
NEW_QUESTIONS = [  # not in the workload: only the system prompt is on disk (one per repeat, so none is cached)
    "Is there a café inside the library where I can buy a coffee?",
    "Can I bring my dog into the reading room?",
    "Do you lend audiobooks or e-readers to members?",
    "Is there a lost and found at the front desk?",
    "May I eat my lunch in the group study rooms?",
    "Does the library offer a scanner I can use for free?",
    "Are there lockers where I can leave my bag?",
    "Can I donate old novels to the library?",
]


def conversations() -> tuple[list[list[dict]], int]:
    data = json.loads(WORKLOAD.read_text())
    system = {"role": "system", "content": data["system"]}
    return [[system, {"role": "user", "content": q}] for q in data["questions"]], int(data["max_new_tokens"])


def phase(args: argparse.Namespace) -> dict:
    """One engine's run (in this process), as a JSON-able dict.

    ``--warmup`` first runs one short unrelated prompt, so the request measured is not the process's first
    forward: that one costs 0.1-0.4 s more, cold or restarted alike (measured here: importing ``statistics``
    before the first forward alone added ~0.4 s to it, for reasons outside pagedkv), which hides what the
    cache saves."""
    from pagedkv import LLM, SamplingParams

    chats, max_tokens = conversations()
    options = {"num_threads": args.threads, "max_model_len": 2048}
    start = time.perf_counter()
    llm = LLM(kv_cache_dir=args.kv_dir, **options)
    result: dict = {"load_s": time.perf_counter() - start}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1)
    if args.phase == "first":
        question = {"role": "user", "content": NEW_QUESTIONS[int(args.question)]} if args.question.isdigit() else None
        chat = chats[0] if question is None else [chats[0][0], question]
        if args.warmup:  # a first forward that shares no block: what a process pays once is paid here
            llm.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)
        out = llm.chat([chat], params, use_tqdm=False)[0]
        result.update(ttft_ms=1000 * out.metrics["ttft"], bits=[[out.outputs[0].token_ids, out.outputs[0].logprobs]])
        result["prompt_tokens"] = len(out.prompt_token_ids)
    else:
        result["bits"] = []
        for name in ("round1", "round2"):
            before = llm.stats()
            start = time.perf_counter()
            outs = llm.chat(chats, params, use_tqdm=False)
            wall = time.perf_counter() - start
            after = llm.stats()
            ttfts = [1000 * o.metrics["ttft"] for o in outs]
            result[name] = {
                "wall_s": wall,
                "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
                "ttft_first_ms": ttfts[0],
                "ttft_mean_ms": sum(ttfts) / len(ttfts),
            }
            result["bits"].append([[o.outputs[0].token_ids, o.outputs[0].logprobs] for o in outs])
    start = time.perf_counter()
    llm.engine.close()  # the queued writes
    result["close_s"] = time.perf_counter() - start
    result["stats"] = {k: v for k, v in llm.stats().items() if k.startswith("disk_") or k == "prefix_cache_hits"}
    return result


def run_phase(name: str, kv_dir: str | None, threads: int, question: str = "workload", warmup: bool = False) -> dict:
    command = [sys.executable, __file__, "--phase", name, "--threads", str(threads), "--question", question]
    command += ["--warmup"] if warmup else []
    if kv_dir is not None:
        command += ["--kv-dir", kv_dir]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"phase {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_block(stats: dict, ms_key: str, count_key: str) -> float | None:
    return round(stats[ms_key] / stats[count_key], 3) if stats.get(count_key) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--phase", choices=("round", "first"), help=argparse.SUPPRESS)
    parser.add_argument("--kv-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--question", default="workload", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return

    import statistics  # not at the top: the phases' processes do not import it (see phase())

    report: dict = {"cpu": cpu_name(), "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="pagedkv-disk-bench-") as tmp:
        kv_dir = str(Path(tmp) / "kv")
        plain = run_phase("round", None, args.threads)
        cold = run_phase("round", kv_dir, args.threads)
        restarted = run_phase("round", kv_dir, args.threads)
        assert cold["bits"] == plain["bits"] and restarted["bits"][0] == plain["bits"][0], "outputs differ"
        written = cold["stats"]
        report["round"] = {
            "no_dir_round1": plain["round1"],
            "writing_round1": cold["round1"],
            "warm_memory_round2": cold["round2"],
            "restarted_round1": restarted["round1"],
            "blocks_written": written["disk_blocks_written"],
            "write_copy_ms_per_block (engine thread)": per_block(written, "disk_store_copy_ms", "disk_blocks_written"),
            "write_ms_per_block (writer thread)": per_block(written, "disk_write_ms", "disk_blocks_written"),
            "close_flush_s": cold["close_s"],
            "blocks_loaded": restarted["stats"]["disk_blocks_loaded"],
            "load_ms_per_block": per_block(restarted["stats"], "disk_load_ms", "disk_blocks_loaded"),
            "directory_mb": sum(p.stat().st_size for p in Path(kv_dir, BLOCKS_DIR).glob("*.safetensors")) / 2**20,
        }
        for question in ("workload", "new"):
            samples: dict[str, list[float]] = {}
            loads: list[float] = []
            for i in range(args.repeats):
                for warmup in (False, True):  # a new question each time: an earlier run wrote its blocks
                    asked = question if question == "workload" else str((2 * i + warmup) % len(NEW_QUESTIONS))
                    cold_first = run_phase("first", None, args.threads, asked, warmup)
                    warm_first = run_phase("first", kv_dir, args.threads, asked, warmup)
                    assert warm_first["bits"] == cold_first["bits"], "the restarted answer differs from the cold one"
                    suffix = "_after_warmup" if warmup else ""
                    samples.setdefault(f"ttft_cold{suffix}_ms", []).append(cold_first["ttft_ms"])
                    samples.setdefault(f"ttft_restarted{suffix}_ms", []).append(warm_first["ttft_ms"])
                    loads.append(warm_first["stats"]["disk_blocks_loaded"])
            entry: dict = {"prompt_tokens": cold_first["prompt_tokens"], "blocks_loaded": sorted(set(loads))}
            for name, values in samples.items():
                entry[name] = [round(x, 1) for x in values]
            for suffix in ("", "_after_warmup"):
                cold_ms, restarted_ms = samples[f"ttft_cold{suffix}_ms"], samples[f"ttft_restarted{suffix}_ms"]
                entry[f"speedup_median{suffix}"] = round(
                    statistics.median(cold_ms) / statistics.median(restarted_ms), 2
                )
            report[f"first_request_{question}"] = entry
    print(json.dumps(report, indent=None if args.json else 2))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        name = "?"
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
