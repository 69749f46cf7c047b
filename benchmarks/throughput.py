"""End-to-end throughput: pagedkv vs HF transformers vs llama.cpp on the shared-prefix chat workload.

    python benchmarks/throughput.py [--workload FILE] [--max-requests N] [--quick] [--json] [--skip NAME ...]

Every engine runs the same conversations (greedy, 2 threads, the default SmolLM2 model) one after another in
this process, so their numbers are comparable within the run. pagedkv runs three ways: fp32 with prefix
caching, fp32 without it, and its fastest configuration (compiled attention kernel, and linear layers on bf16
where the CPU has bf16 GEMMs, else on the model file's exact Q4_1/Q8_0 codes through the panel GEMM).
Results: a table on stdout, Markdown + PNG + JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, write_json  # noqa: E402
from peers import RunResult, run_hf_generate, run_hf_generate_batch, run_llama_cpp  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.model.loader import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def native_bf16() -> bool:
    """bf16 GEMMs pay only on CPUs with bf16 instructions (AVX-512 BF16 / AMX); on AVX2 they ran ~3x slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# bf16 linears where the CPU has bf16 GEMMs; elsewhere the GGUF's exact 4-/8-bit codes on the panel GEMM
FASTEST_FORMAT = "bfloat16" if native_bf16() else "gguf"
PAGEDKV_CONFIGS = {
    "pagedkv fp32, prefix caching": {"weight_format": "float32", "enable_prefix_caching": True},
    "pagedkv fp32, no prefix caching": {"weight_format": "float32", "enable_prefix_caching": False},
    f"pagedkv fastest ({FASTEST_FORMAT} linears, kernel)": {
        "weight_format": FASTEST_FORMAT,
        "enable_prefix_caching": True,
        "attention_backend": "kernel",
    },
}


def run_pagedkv(name: str, options: dict, conversations, max_new_tokens: int, threads: int) -> RunResult:
    llm = LLM(num_threads=threads, **options)
    llm.chat(
        [[{"role": "user", "content": "Warm up."}]],
        SamplingParams(max_tokens=4, temperature=0),
        use_tqdm=False,
    )
    llm.reset_prefix_cache()
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.chat(conversations, SamplingParams(max_tokens=max_new_tokens, temperature=0), use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.stats()
    tpots = [
        (o.metrics["last_token_time"] - o.metrics["arrival_time"] - o.metrics["ttft"])
        / max(len(o.token_ids) - 1, 1)
        * 1000
        for o in outputs
    ]
    return RunResult(
        name,
        wall,
        sum(len(o.token_ids) for o in outputs),
        sum(len(o.prompt_token_ids) for o in outputs),
        int(after["prompt_tokens_computed"] - before["prompt_tokens_computed"]),
        [o.metrics["ttft"] * 1000 for o in outputs],
        tpots,
        [o.token_ids for o in outputs],
        note=f"attention: {llm.engine.attention.name}",
    )


def load_conversations(path: Path, max_requests: int | None) -> tuple[list, int]:
    data = json.loads(path.read_text())
    questions = data["questions"][:max_requests]
    return [[{"role": "system", "content": data["system"]}, {"role": "user", "content": q}] for q in questions], int(
        data.get("max_new_tokens", 64)
    )


def load_hf_model(threads: int):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = Path(default_model_path())
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def summarize(results: list[RunResult]) -> dict:
    by_name = {r.name: r for r in results}
    tps = {r.name: r.output_tokens / r.wall_s for r in results}
    fp32, off, fast = (by_name.get(n) for n in PAGEDKV_CONFIGS)
    hf = by_name.get("HF transformers generate (padded batch)")
    llama = next((r for r in results if r.name.startswith("llama.cpp")), None)
    summary: dict = {}
    if fp32 and hf:
        summary["fp32_vs_hf_generate"] = round(tps[fp32.name] / tps[hf.name], 2)
    if fp32 and llama:
        summary["fp32_vs_llama_cpp"] = round(tps[fp32.name] / tps[llama.name], 2)
    if fast and llama:
        summary["fastest_vs_llama_cpp"] = round(tps[fast.name] / tps[llama.name], 2)
    if fp32 and off and off.prompt_tokens_computed:
        summary["prompt_computed_on_vs_off"] = round(fp32.prompt_tokens_computed / off.prompt_tokens_computed, 3)
    if fp32 and fast and fp32.outputs and fast.outputs:
        same = sum(a == b for a, b in zip(fp32.outputs, fast.outputs))
        summary["fastest_outputs_equal_fp32"] = f"{same}/{len(fp32.outputs)}"
    return summary


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.6 * len(results) + 1.5))
    names = [r.name for r in results][::-1]
    values = [r.output_tokens / r.wall_s for r in results][::-1]
    ax.barh(names, values, color=["#4C72B0" if n.startswith("pagedkv") else "#999999" for n in names])
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.0f}", va="center")
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title("shared-prefix chat workload, SmolLM2-135M, 2 CPU threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, default=ROOT / "workloads" / "chat_shared_prefix.json")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="override the workload's")
    parser.add_argument(
        "--quick", action="store_true", help="4 requests, 16 tokens, pagedkv fp32 with and without prefix caching"
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="engines to skip: hf, hf-batch, llama, pagedkv-off, pagedkv-fast",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the JSON summary to stdout")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    skip = set(args.skip)
    if args.quick:
        args.max_requests, args.max_new_tokens = args.max_requests or 4, args.max_new_tokens or 16
        skip |= {"hf", "hf-batch", "llama", "pagedkv-fast"}
    torch.set_num_threads(args.threads)
    conversations, max_new_tokens = load_conversations(args.workload, args.max_requests)
    max_new_tokens = args.max_new_tokens or max_new_tokens
    log = sys.stderr if args.json else sys.stdout

    results: list[RunResult] = []
    skips = dict(zip(list(PAGEDKV_CONFIGS)[1:], ["pagedkv-off", "pagedkv-fast"]))
    for name, options in PAGEDKV_CONFIGS.items():
        if skips.get(name) not in skip:
            print(f"running {name} ...", file=log, flush=True)
            results.append(run_pagedkv(name, options, conversations, max_new_tokens, args.threads))
    if not {"hf", "hf-batch", "llama"} <= skip:
        reference = LLM(num_threads=args.threads)
        prompts = [reference.engine.apply_chat_template(c) for c in conversations]
        eos_ids = set(reference.engine.eos_token_ids)
        del reference
    if not {"hf", "hf-batch"} <= skip:
        model = load_hf_model(args.threads)
        if "hf" not in skip:
            print("running HF transformers generate ...", file=log, flush=True)
            results.append(run_hf_generate(model, prompts, max_new_tokens, pad_id=min(eos_ids), eos_ids=eos_ids))
        if "hf-batch" not in skip:
            print("running HF transformers generate_batch ...", file=log, flush=True)
            try:
                results.append(run_hf_generate_batch(model, prompts, max_new_tokens, eos_ids))
            except Exception as exc:  # a peer's failure must not hide the other results
                print(f"HF generate_batch failed: {exc!r}", file=log)
        del model
    notes = []
    if "llama" not in skip:
        print("running llama.cpp ...", file=log, flush=True)
        llama = run_llama_cpp(default_model_path(), conversations, prompts, max_new_tokens, args.threads)
        if llama is None:
            notes.append("llama.cpp skipped: llama-cpp-python is not installed (pip install -e '.[bench]')")
        else:
            results.append(llama)

    rows = [r.row() for r in results]
    summary = summarize(results)
    headers = [
        "engine",
        "wall_s",
        "output_tok_s",
        "prompt_tokens_computed",
        "prefix_hit_rate",
        "ttft_mean_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_ms",
    ]
    table = [[row[h] if row[h] is not None else "-" for h in headers] for row in rows]
    print(format_table(headers, table), file=log)
    for key, value in summary.items():
        print(f"{key}: {value}", file=log)
    for note in notes:
        print(note, file=log)
    machine = f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    markdown = format_table(headers, table, markdown=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "throughput.md").write_text(
        f"Workload: {args.workload.name}, {len(conversations)} requests, {max_new_tokens} new tokens, "
        f"greedy; {machine}\n\n" + markdown + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in summary.items()) + "\n"
    )
    plot(results, args.out_dir / "throughput.png")
    data = {
        "workload": str(args.workload),
        "requests": len(conversations),
        "max_new_tokens": max_new_tokens,
        "results": rows,
        "summary": summary,
        "notes": notes,
        "ttft_mean_ms_all": statistics.mean(t for r in results for t in r.ttft_ms)
        if any(r.ttft_ms for r in results)
        else None,
    }
    write_json(data, args.out_dir / "throughput.json")
    if args.json:
        print(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
