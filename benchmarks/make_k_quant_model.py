"""A K-quant GGUF model of a real size, made here: for measuring loads, memory and speed on a file like the ones
people download, without downloading one.

    python benchmarks/make_k_quant_model.py [--out /tmp/llama-1b-q4_k_m.gguf] [--ftype Q4_K_M]

The default model (SmolLM2-135M, hidden size 576) cannot be a real Q4_K_M: K-quant rows are whole
256-weight blocks, so llama.cpp's quantiser falls back to Q5_0 for most of its tensors. This writes a Llama of
TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 query / 4 KV heads, MLP 5632) with random weights (normal,
std 0.02, as an initialiser makes them) and the default model's tokenizer and chat template as an F16 GGUF,
then has llama.cpp's own quantiser (``llama_model_quantize`` in llama-cpp-python, the ``[bench]`` extra) turn
it into ``--ftype``: the same tensor types, mixed per layer, as a downloaded Q4_K_M of that model.
Random weights make its text meaningless, not its arithmetic: every engine computes the same kernels on it.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "mlp": 5632, "context": 2048}


def write_f16(path: Path, seed: int = 0) -> None:
    import gguf

    from pagedkv.model.gguf_file import GGUFFile
    from pagedkv.model.loader import default_model_path

    tokenizer = GGUFFile(default_model_path()).metadata
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    s = SHAPE
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("pagedkv-bench-llama-1.1b")
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["mlp"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value in tokenizer.items():
        if key.startswith("tokenizer."):
            _copy(writer, key, value)
    rng = np.random.default_rng(seed)
    head_dim = s["hidden"] // s["heads"]

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", weight(vocab, s["hidden"]))
    writer.add_tensor("output_norm.weight", np.ones(s["hidden"], dtype=np.float32))
    writer.add_tensor("output.weight", weight(vocab, s["hidden"]))
    for i in range(s["layers"]):
        shapes = {
            "attn_q": (s["hidden"], s["hidden"]),
            "attn_k": (s["kv_heads"] * head_dim, s["hidden"]),
            "attn_v": (s["kv_heads"] * head_dim, s["hidden"]),
            "attn_output": (s["hidden"], s["hidden"]),
            "ffn_gate": (s["mlp"], s["hidden"]),
            "ffn_up": (s["mlp"], s["hidden"]),
            "ffn_down": (s["hidden"], s["mlp"]),
        }
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(rows, cols))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(s["hidden"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy(writer, key: str, value) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_array(key, value)


def quantize(source: Path, out: Path, ftype: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp's quantiser failed on {source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "llama-1b-q4_k_m.gguf")
    parser.add_argument("--ftype", default="Q4_K_M", help="llama.cpp's file type: Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.out.parent) as scratch:
        f16 = Path(scratch) / "f16.gguf"
        write_f16(f16)
        quantize(f16, args.out, args.ftype, args.threads)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
