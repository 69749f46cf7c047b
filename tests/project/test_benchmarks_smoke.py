"""The benchmarks run end to end in quick mode and print well-formed summaries.

Only the structure is checked, never the timings: the machine is shared and noisy.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.tiny_model import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["loop", "indexed", "gather_kv", "slots+sel", "slots_out", "floor"]
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2}
# The tiny model's words are w0..w511 (every other word is w0): each message between two of them
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)


def run_quick_json(script: str, *options: str) -> dict:
    """Run ``benchmarks/<script> --quick --json`` with one thread and return its JSON summary.

    One thread: on a shared 2-core machine a 2-thread op can stall for milliseconds per call.
    """
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--quick", "--json", "--threads", "1", *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_gather_quick_json(tmp_path):
    plot, out_json = tmp_path / "gather.png", tmp_path / "gather.json"
    summary = run_quick_json("gather.py", "--plot", str(plot), "--out-json", str(out_json))
    assert summary == json.loads(out_json.read_text())
    assert summary["benchmark"] == "gather" and summary["unit"] == "us" and summary["quick"] is True
    assert summary["methods"] == METHODS
    assert summary["threads"] == 1 and summary["block_size"] == 16
    assert summary["rows"], "quick mode must still time something"
    for row in summary["rows"]:
        assert set(row["times_us"]) == set(row["min_us"]) == set(METHODS)
        assert all(row["min_us"][m] <= row["times_us"][m] for m in METHODS)
        assert all(math.isfinite(t) and t > 0 for t in row["times_us"].values())
        assert row["bytes"] == row["seq_len"] * row["num_kv_heads"] * row["head_dim"] * ELEMENT_SIZE[row["dtype"]]
        assert math.isclose(row["loop_over_ours"], row["times_us"]["loop"] / row["times_us"]["gather_kv"])
        assert math.isclose(row["ours_over_floor"], row["times_us"]["gather_kv"] / row["times_us"]["floor"])
    (accepted,) = summary["acceptance"]
    assert set(accepted) == {"num_kv_heads", "head_dim", "loop_over_ours", "ours_over_floor", "met"}
    assert isinstance(accepted["met"], bool)
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_quick_json():
    summary = run_quick_json("attention.py", "--plot", "")
    assert summary["rows"], "quick mode must still time something"
    assert all(row["times_us"]["kernel_fp16"] > 0 and row["kernel_over_fp16"] > 0 for row in summary["rows"])


@pytest.mark.slow  # the default model
def test_throughput_quick_json(tmp_path):
    """Two requests of 4 tokens: the second still finds the system prompt the first left in the cache."""
    options = ["--max-requests", "2", "--max-new-tokens", "4", "--out-dir", str(tmp_path)]
    summary = run_quick_json("throughput.py", *options)
    engines = [row["engine"] for row in summary["results"]]
    assert engines == ["pagedkv fp32, prefix caching", "pagedkv fp32, no prefix caching"]
    on, off = summary["results"]
    assert on["prompt_tokens"] == off["prompt_tokens"] and off["prefix_hit_rate"] == 0
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]
    assert all(row["output_tok_s"] > 0 for row in summary["results"])
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the default model
def test_structured_quick_json():
    summary = run_quick_json("structured.py")
    assert set(summary["tokens_per_s"]) == {"unconstrained", "json_schema"}
    assert all(rate > 0 for rate in summary["tokens_per_s"].values())
    grammar = summary["grammar_ms_per_step"]
    assert grammar["steps"] > 0 and grammar["compute"] > 0 and grammar["apply"] > 0  # the masks were used


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A tiny random Llama (4 query / 2 KV heads: it splits 2 ways) with a chat template."""
    directory = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def test_tensor_parallel_quick_json(tiny_chat_model):
    """The script on 2 ranks and a tiny model: the default model's 9 heads need 3 ranks, 3 processes loading it,
    and tests/parallel/test_tensor_parallel.py already holds it at TP=3 to TP=1's greedy answers and exact bits."""
    summary = run_quick_json("tensor_parallel.py", "--size", "2", "--model", str(tiny_chat_model))
    assert summary["size"] == 2 and summary["end_to_end"]["greedy_tokens_equal"] is True
    assert summary["end_to_end"]["exact_bitwise_equal"] is True
    assert all(math.isfinite(t) and t > 0 for t in summary["collectives_us"].values())


def test_panel_linear_quick_runs():
    """The linear-layer benchmark checks every candidate against MKL before timing it; it must get that far."""
    result = subprocess.run(
        [sys.executable, "benchmarks/panel_linear.py", "--quick", "--rows", "1", "7", "--threads", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    table = result.stdout.splitlines()
    assert table[1].split()[:4] == ["rows", "mkl_ms", "panel_fp32_ms", "panel_q4_ms"]
    assert [line.split()[0] for line in table[2:]] == ["1", "7"]


@pytest.mark.slow  # the default model
def test_serving_quick_json(tmp_path):
    """The pagedkv side of the serving benchmark: a real `pagedkv serve` subprocess per concurrency, driven by
    the streaming OpenAI client, started and stopped by the script."""
    summary = run_quick_json(
        "serving.py", "--skip-llama", "--speculative", "2", "--fp16-kv", "--int8", "--out-dir", str(tmp_path)
    )
    assert summary["notes"] == ["llama-server skipped: --skip-llama"] and summary["llama_server"] is None
    rows = summary["results"]
    spec, half, int8 = "pagedkv gguf + speculation", "pagedkv gguf, fp16 KV", "pagedkv gguf-int8 (opt-in)"
    assert [(row["engine"], row["concurrency"]) for row in rows] == [
        ("pagedkv fp32", 1),
        (spec, 1),
        (half, 1),
        (int8, 1),
        ("pagedkv fp32", 4),
        (spec, 4),
        (half, 4),
        (int8, 4),
    ]
    for row in rows:
        assert row["requests"] == 4 and 0 < row["output_tokens"] <= 4 * 8
        assert row["output_tok_s"] > 0 and 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["prompt_cached_share"] > 0.5  # the warm-up request left the system prompt in the cache
        assert 200 < row["peak_rss_mb"] < 8192  # the server's own high-water mark, read from /proc
    for c in (1, 4):  # exact codes and speculation keep fp32's greedy answers (fp16 KV is not held to that)
        assert summary["summary"][f"concurrency {c}"]["answers_equal_fp32"][spec] == "4/4"
    by_engine = {(row["engine"], row["concurrency"]): row for row in rows}
    for c in (1, 4):  # the same 16,384 tokens of KV in half the bytes, and codes instead of fp32 weights
        assert by_engine[half, c]["peak_rss_mb"] < by_engine["pagedkv fp32", c]["peak_rss_mb"] - 500
    assert json.loads((tmp_path / "serving.json").read_text())["results"] == rows
    assert "| concurrency | engine |" in (tmp_path / "serving.md").read_text()


@pytest.mark.slow  # the default model
def test_serving_quick_llama_server(tmp_path):
    """The llama-server side (`make llama-server` builds it); skipped, with the script's reason, without it."""
    summary = run_quick_json("serving.py", "--skip-pagedkv", "--concurrency", "4", "--out-dir", str(tmp_path))
    if summary["llama_server"] is None:
        pytest.skip(summary["notes"][0])
    (row,) = summary["results"]
    assert row["engine"] == "llama-server -np 4" and row["parallel"] == 4 and row["concurrency"] == 4
    assert row["output_tok_s"] > 0 and 0 < row["output_tokens"] <= 4 * 8


def test_moe_layer_quick_json():
    """The grouped block and the per-token loop ran on the same steps (the script exits if their bits differ)."""
    summary = run_quick_json("moe_layer.py")
    assert summary["benchmark"] == "moe_layer" and summary["quick"] is True
    assert [row["tokens"] for row in summary["rows"]] == [1, 8, 64]
    for row in summary["rows"]:
        assert row["experts_read"] <= min(8, row["expert_calls_in_loop"])
        assert row["grouped_us"] > 0 and row["loop_us"] > 0
