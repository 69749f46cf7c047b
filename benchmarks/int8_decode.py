"""weight_format "gguf" (exact) against "gguf-int8" (llama.cpp's arithmetic) and llama.cpp itself, in one process.

    python benchmarks/int8_decode.py --model /tmp/llama-1b-q4_k_m.gguf [--decode 32] [--rounds 3] [--rows 32]

The three engines are loaded side by side (the file is mapped once in the page cache) and timed in alternation,
``--rounds`` times, so that a shared, noisy machine weighs on each alike; every round's figure is printed, then
each engine's range. One request decodes ``--decode`` tokens greedily after a 64-token prompt: tokens/s past
the first token (the same request with max_tokens=1 is timed and subtracted), as benchmarks/gguf_load.py does.

``--rows R`` also times one R-row step of every linear layer of the model (what a batch of R decoding requests
costs in the GEMMs), exact against int8: milliseconds per step, over the same rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = list(range(1000, 1064))
FORMATS = ("gguf", "gguf-int8")


def pagedkv_decode(llm, tokens: int) -> float:
    from pagedkv import SamplingParams

    def run(n: int) -> float:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(
            prompt_token_ids=[PROMPT],
            sampling_params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        return time.perf_counter() - start

    return tokens / (run(tokens + 1) - run(1))


def llama_cpp_decode(llm, tokens: int) -> float:
    def run(n: int) -> float:
        llm.reset()
        start = time.perf_counter()
        for count, _ in enumerate(llm.generate(PROMPT, temp=0.0, reset=True), 1):
            if count == n:
                break
        return time.perf_counter() - start

    return tokens / (run(tokens + 1) - run(1))


def linear_step_ms(llm, rows: int) -> float:
    """One ``rows``-row call of every linear layer (LM head included), in milliseconds."""
    import torch

    from pagedkv.model.layers import Linear

    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    inputs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1]) for m in linears}
    start = time.perf_counter()
    with torch.inference_mode():
        for m in linears:
            m(inputs[m.weight.shape[1]])
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=0, help="also time an R-row step of the linears")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()

    import torch

    from pagedkv import LLM
    from pagedkv.extension import cpu_flags

    torch.set_num_threads(args.threads)
    engines = {f: LLM(model=args.model, weight_format=f, kv_cache_memory_gb=0.25) for f in FORMATS}
    timers = {f"pagedkv {f}": (lambda llm=llm: pagedkv_decode(llm, args.decode)) for f, llm in engines.items()}
    if not args.no_llama_cpp:
        from llama_cpp import Llama

        cpp = Llama(
            model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024, verbose=False
        )
        timers["llama.cpp"] = lambda: llama_cpp_decode(cpp, args.decode)
    if args.rows:
        for f, llm in engines.items():
            timers[f"{args.rows}-row linears {f} (ms)"] = lambda llm=llm: linear_step_ms(llm, args.rows)
    for timer in timers.values():  # warm-up
        timer()
    results: dict[str, list[float]] = {name: [] for name in timers}
    for round_ in range(args.rounds):
        for name, timer in timers.items():
            results[name].append(timer())
        print(f"round {round_ + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in results.items()), flush=True)
    isa = "AVX-512" if "avx512f" in cpu_flags().split() else "AVX2"
    print(
        f"{Path(args.model).name}, {args.threads} threads, {isa} CPU; decode tok/s of one request ({args.decode} "
        f"tokens), min-max over {args.rounds} alternating rounds:"
    )
    for name, values in results.items():
        print(f"  {name:34} {min(values):7.1f} - {max(values):7.1f}")


if __name__ == "__main__":
    main()
