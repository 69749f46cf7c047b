"""Loading a GGUF file: time to ready and memory, pagedkv next to llama.cpp, each in a fresh process.

    python benchmarks/gguf_load.py [--model FILE.gguf] [--cold] [--decode 64] [--threads 2] [--json out.json]
                                   [--weight-format gguf gguf-int8] [--pair]

For each engine a new Python process loads the model and reports (as JSON on its last line):

- ``ready_s``: from the start of the load to an engine that can take requests (pagedkv: ``LLM(model=...)``;
  llama.cpp: ``llama_cpp.Llama(...)``, llama-cpp-python), imports excluded.
- ``peak_rss_mib``: the process's peak resident set (``ru_maxrss``), imports included; ``rss_mib`` and
  ``pss_mib`` after the load, or after the decode with ``--decode`` (a format that reads the mapped file in
  place, ``gguf-int8``, pages it in as its first steps touch it) (``/proc/self/smaps_rollup``; PSS counts a
  page shared with another process by halves, so two engines mapping one file show what they really cost
  together).
- ``weights_mib``: pagedkv's packed weights (what the panel GEMM reads), and the KV pool.

``--decode N`` then has each engine generate N tokens greedily for one 64-token prompt, alone (what one user
chatting sees), and reports ``decode_tok_s``: N over the time past the first token (timed as the same request
with ``max_tokens=1``, in the same process, and subtracted).

``--weight-format`` runs pagedkv once per format given (default ``gguf``; ``gguf-int8`` is the opt-in
int8-activation format, docs/int8-activations.md). ``--cold`` runs pagedkv once more per format with an empty
``$PAGEDKV_CACHE_DIR`` first: its kernels compiled and the file's metadata converted, as on a machine that
never ran it. ``--pair`` then loads two pagedkv engines at once per format, as two servers on one machine
would, and reports each one's PSS and ``file_pss_mib``, its share of the file's mapped pages: whether the two
hold the weights once (the pages shared) or twice (each its own copy). The KV pool is sized to 256 MiB on
both sides (pagedkv: ``kv_cache_memory_gb``; llama.cpp: ``n_ctx`` tokens of its fp16 cache).
State the CPU with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KV_MIB = 256


def _memory() -> dict[str, float]:
    """This process's RSS and PSS now, and its peak RSS."""
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return _proc_memory(os.getpid()) | {"peak_rss_mib": peak}


PROMPT = list(range(1000, 1064))  # token ids: every vocabulary here is larger


def _file_memory(pid: int, model: str) -> dict[str, float]:
    """Resident and proportional memory of the process's mappings of the GGUF file(s), from /proc/PID/smaps."""
    names = {str(p.resolve()) for p in _files(model)}
    totals = {"Rss:": 0, "Pss:": 0}
    in_file = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:  # a mapping's header line: its path is the last field
                in_file = len(parts) >= 6 and parts[-1] in names
            elif in_file and parts[0] in totals:
                totals[parts[0]] += int(parts[1])
    return {"file_rss_mib": round(totals["Rss:"] / 1024, 1), "file_pss_mib": round(totals["Pss:"] / 1024, 1)}


def child_pagedkv(model: str, threads: int, decode: int, weight_format: str = "gguf") -> tuple[dict, object]:
    """The measurements, and the engine itself: a caller that measures this process again keeps it alive."""
    import torch

    from pagedkv import LLM, SamplingParams
    from pagedkv.model.layers import Linear

    torch.set_num_threads(threads)
    start = time.perf_counter()
    llm = LLM(model=model, kv_cache_memory_gb=KV_MIB / 1024, weight_format=weight_format)
    ready = time.perf_counter() - start
    net = llm.engine.runner.model
    weights = sum(p.packed.nbytes for m in net.modules() if isinstance(m, Linear) for p in m.panels)
    weights += sum(t.nbytes for t in net.state_dict().values())  # norms, biases, unpacked weights
    kv = sum(k.nbytes + v.nbytes for k, v in llm.engine.runner.kv_caches)
    measured = {"ready_s": round(ready, 2), "weights_mib": round(weights / 2**20, 1), "kv_mib": round(kv / 2**20, 1)}
    measured |= _memory()  # while the engine is alive
    if decode:

        def run(tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)
            return time.perf_counter() - start

        run(4)  # warm-up
        measured["decode_tok_s"] = round(decode / (run(decode + 1) - run(1)), 1)
        # again after decoding: the peak then counts the steps' scratch (activations, logits) as well as the weights
        measured |= _memory()
    return measured, llm


def child_llama_cpp(model: str, threads: int, decode: int) -> tuple[dict, object]:
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=_llama_ctx(model), verbose=False)
    ready = time.perf_counter() - start
    llm.tokenize(b"hi")
    measured = {"ready_s": round(ready, 2), "n_ctx": llm.n_ctx()} | _memory()  # while the engine is alive
    if decode:

        def run(tokens: int) -> float:
            llm.reset()  # no reuse of the previous prompt's KV
            start = time.perf_counter()
            for count, _ in enumerate(llm.generate(PROMPT, temp=0.0, reset=True), 1):
                if count == tokens:
                    break
            return time.perf_counter() - start

        run(4)
        measured["decode_tok_s"] = round(decode / (run(decode + 1) - run(1)), 1)
    return measured, llm


def _llama_ctx(model: str) -> int:
    """Tokens of llama.cpp's fp16 KV cache in KV_MIB, for the file's layers, KV heads and head size."""
    from pagedkv.model.gguf_file import GGUFFile

    meta = GGUFFile(model).metadata
    arch = meta["general.architecture"]
    layers, heads = meta[f"{arch}.block_count"], meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // heads
    per_token = 2 * layers * kv_heads * head_dim * 2
    return KV_MIB * 2**20 // per_token // 256 * 256


def _run(
    engine: str, model: str, threads: int, decode: int, env: dict | None = None, weight_format: str = "gguf"
) -> dict:
    command = [sys.executable, __file__, "--child", engine, "--model", model, "--threads", str(threads)]
    command += ["--decode", str(decode), "--weight-format", weight_format]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_pair(model: str, threads: int, weight_format: str) -> list[dict]:
    """Two pagedkv engines loading ``model`` side by side; each one's memory (and its share of the file's
    mapped pages) read while both are alive."""
    command = [sys.executable, __file__, "--child", "pagedkv", "--model", model, "--threads", str(threads)]
    command += ["--weight-format", weight_format, "--decode", "4", "--hold"]  # a decode touches every weight
    children = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        results = []
        for child in children:
            line = child.stdout.readline()
            results.append(json.loads(line) if line else {"error": f"exit {child.wait()}"})
        for child, result in zip(children, results, strict=True):
            if "error" not in result:
                result.pop("decode_tok_s", None)  # 4 tokens: not a speed worth reporting
                result |= _proc_memory(child.pid) | _file_memory(child.pid, model)
        return results
    finally:
        for child in children:
            child.stdin.close()
            child.wait(timeout=60)


def _proc_memory(pid: int) -> dict[str, float]:
    """RSS and PSS of a live process, from /proc/PID/smaps_rollup."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Rss:", "Pss:"):
                fields[parts[0][:-1].lower() + "_mib"] = round(int(parts[1]) / 1024, 1)
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="also time a first load with empty caches")
    parser.add_argument("--decode", type=int, default=0, help="also time N greedy tokens of one request")
    parser.add_argument("--child", choices=["pagedkv", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--weight-format", nargs="+", default=["gguf"], help="pagedkv's weight formats to run")
    parser.add_argument("--pair", action="store_true", help="also load two pagedkv engines at once: their PSS")
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)  # a child waits for stdin to close
    args = parser.parse_args()
    if args.model is None:
        from pagedkv.model.loader import default_model_path

        args.model = default_model_path()
    if args.child:
        if args.child == "pagedkv":
            result, engine = child_pagedkv(args.model, args.threads, args.decode, args.weight_format[0])
        else:
            result, engine = child_llama_cpp(args.model, args.threads, args.decode)
        print(json.dumps(result), flush=True)
        if args.hold:  # the engine kept alive (and mapping the file) until the parent has measured both
            sys.stdin.read()
        del engine
        return
    from pagedkv.extension import cpu_flags

    results = {}
    for weight_format in args.weight_format:
        name = "pagedkv" if weight_format == "gguf" else f"pagedkv {weight_format}"
        if args.cold:
            with tempfile.TemporaryDirectory() as empty:
                cold = os.environ | {"PAGEDKV_CACHE_DIR": empty}
                results[f"{name} (cold)"] = _run("pagedkv", args.model, args.threads, 0, cold, weight_format)
        results[name] = _run("pagedkv", args.model, args.threads, args.decode, weight_format=weight_format)
        if args.pair:
            for i, result in enumerate(_run_pair(args.model, args.threads, weight_format)):
                results[f"{name} (pair {i + 1})"] = result
    results["llama.cpp"] = _run("llama.cpp", args.model, args.threads, args.decode)
    isa = "AVX-512" if "avx512f" in cpu_flags().split() else "AVX2"
    file_mib = sum(p.stat().st_size for p in _files(args.model)) / 2**20
    print(f"{Path(args.model).name}: {file_mib:.0f} MiB, KV pool {KV_MIB} MiB, {args.threads} threads, {isa} CPU")
    keys = ["ready_s", "peak_rss_mib", "rss_mib", "pss_mib", "file_pss_mib", "weights_mib", "kv_mib", "decode_tok_s"]
    print(f"{'engine':22}" + "".join(f"{k:>14}" for k in keys))
    for name, result in results.items():
        print(f"{name:22}" + "".join(f"{result.get(k, '-')!s:>14}" for k in keys) + f"  {result.get('error', '')}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "file_mib": file_mib, "results": results}, indent=2))


def _files(model: str) -> list[Path]:
    from pagedkv.model.gguf_file import split_files

    return split_files(Path(model))


if __name__ == "__main__":
    main()
