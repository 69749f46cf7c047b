"""Greedy tokens and logprobs of pagedkv on a GGUF file, against HF transformers loading the same file.

    python benchmarks/gguf_vs_hf.py [--model FILE.gguf] [--tokens 16] [--weight-format gguf]

The tests hold every GGUF type to HF on tiny generated models (tests/test_gguf_native.py); this checks a real,
model-sized file the same way. pagedkv generates ``--tokens`` greedy tokens, with their logprobs, for three
prompts of token ids; then HF transformers (which de-quantises every tensor to fp32 with the gguf package)
scores prompt + those tokens in one forward pass, teacher-forced, so every step of ours is compared with HF's
distribution at the same position. Reported: how many of our tokens are HF's argmax (or within 1e-4 of HF's
top logprob, a tie at the tolerance), and the largest |logprob difference|. HF needs the model's fp32 weights
in memory (4 bytes a weight: ~4.4 GB for a 1.1B model). The exact format (``gguf``) should give every token
and differences of a few 1e-6; ``gguf-int8`` rounds activations to int8 (docs/int8-activations.md) and does not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [list(range(1000, 1064)), [1, 450, 7483, 310, 3444, 338], [1, 17, 29, 31, 2000, 2001, 2002, 5]]
TOLERANCE = 1e-4


def pagedkv_tokens(model: str, tokens: int, weight_format: str) -> list[tuple[list[int], list[float]]]:
    """(token ids, their logprobs) of a greedy generation per prompt."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=model, weight_format=weight_format, kv_cache_memory_gb=0.25)
    params = SamplingParams(max_tokens=tokens, temperature=0, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    llm.engine.close()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def compare(model: str, generated: list[tuple[list[int], list[float]]]) -> dict:
    """Teacher-forced HF logprobs at each generated position, against ours."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    equal = total = 0
    worst = 0.0
    for prompt, (tokens, logprobs) in zip(PROMPTS, generated, strict=True):
        with torch.no_grad():
            rows = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].double(), dim=-1)
        for step, (token, ours) in enumerate(zip(tokens, logprobs, strict=True)):
            row = rows[len(prompt) + step - 1]
            top2 = torch.topk(row, 2).values
            equal += token == row.argmax().item() or (top2[0] - top2[1]).item() < TOLERANCE
            total += 1
            worst = max(worst, abs(ours - row[token].item()))
    return {"tokens_equal": equal, "tokens": total, "max_abs_logprob_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--weight-format", default="gguf", help="pagedkv's weight format")
    args = parser.parse_args()
    if args.model is None:
        from pagedkv.model.loader import default_model_path

        args.model = str(default_model_path())
    start = time.perf_counter()
    generated = pagedkv_tokens(args.model, args.tokens, args.weight_format)
    result = compare(args.model, generated)
    print(
        f"{Path(args.model).name}, weight_format={args.weight_format}: {result['tokens_equal']} of "
        f"{result['tokens']} greedy tokens are HF's argmax, logprobs within {result['max_abs_logprob_diff']:.2g} "
        f"({len(PROMPTS)} prompts, {time.perf_counter() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
