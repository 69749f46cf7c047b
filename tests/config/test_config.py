"""EngineConfig: every field documented for the CLI generator, allowed values checked once, and the old option
names (``dtype``, ``linear_backend``) still working for one release, with a DeprecationWarning."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedkv import LLM
from pagedkv.attention import paged
from pagedkv.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, WEIGHT_FORMATS, EngineConfig
from pagedkv.entrypoints.cli import add_engine_args, engine_kwargs
from pagedkv.kv import disk_files
from pagedkv.kv.ops import KV_DTYPES
from pagedkv.model.layers import WEIGHT_DTYPES


def test_every_field_says_what_it_does():
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("help"), f"EngineConfig.{f.name} has no help text"
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(EngineConfig) if "choices" in f.metadata}
    assert choices == {
        "weight_format": WEIGHT_FORMATS,
        "attention_backend": ATTENTION_BACKENDS,
        "kv_cache_dtype": KV_CACHE_DTYPES,
        "max_tokens_policy": ("reject", "clamp"),
    }


def test_the_allowed_names_are_the_ones_the_implementations_take(monkeypatch):
    """config.py lists the names without loading the implementations; each implementation's table has exactly
    those names, and the attention backend's own choice (by environment variable) refuses any other."""
    assert sorted(WEIGHT_DTYPES) == sorted(WEIGHT_FORMATS)
    assert sorted(KV_DTYPES) == sorted(KV_CACHE_DTYPES)
    assert set(disk_files._SAFETENSORS_NAMES) == set(KV_DTYPES.values())  # the disk tier names each pool dtype
    assert sorted([paged.KernelAttention.name, paged.TorchAttention.name]) == sorted(ATTENTION_BACKENDS)
    monkeypatch.setenv(paged.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="is not one of"):
        paged.select_backend(None)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"weight_format": "q4"}, r"weight_format must be one of \('float32', 'bfloat16', 'gguf', 'gguf-int8'\)"),
        ({"attention_backend": "flash"}, r"attention_backend must be one of \('kernel', 'gather'\)"),
        ({"kernels": "panel"}, "kernels must be True, False or None"),
        ({"dtype": "fp16"}, "dtype must be one of"),
        ({"linear_backend": "mkl"}, "linear_backend must be one of"),
        ({"max_tokens_policy": "truncate"}, r"max_tokens_policy must be one of \('reject', 'clamp'\)"),
    ],
)
def test_bad_values_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


@pytest.mark.parametrize(
    ("old", "weight_format", "kernels"),
    [
        ({"dtype": "q4"}, "gguf", None),
        ({"dtype": "bfloat16"}, "bfloat16", None),
        ({"linear_backend": "panel"}, None, True),  # weight_format None: by the model file
        ({"linear_backend": "torch"}, None, False),
        ({"dtype": "q4", "weight_format": "gguf", "linear_backend": "torch", "kernels": False}, "gguf", False),
    ],
)
def test_deprecated_names_map_to_the_new_fields(old, weight_format, kernels):
    with pytest.warns(DeprecationWarning, match="is deprecated: use"):
        config = EngineConfig(**old)
    assert (config.weight_format, config.kernels) == (weight_format, kernels)
    assert config.dtype is None and config.linear_backend is None  # one source of truth after mapping


def test_deprecated_names_that_contradict_the_new_ones_are_refused():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="contradicts weight_format='bfloat16'"):
        EngineConfig(dtype="q4", weight_format="bfloat16")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="contradicts kernels=True"):
        EngineConfig(linear_backend="torch", kernels=True)


def test_llm_still_takes_the_old_names():
    """``LLM(dtype="q4")`` reaches EngineConfig, which maps it (the bad block count stops it before a load)."""
    with pytest.warns(DeprecationWarning) as warned, pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(dtype="q4", linear_backend="panel", num_kv_blocks=0)
    assert [str(w.message) for w in warned] == [
        "dtype='q4' is deprecated: use weight_format='gguf'",
        "linear_backend='panel' is deprecated: use kernels=True",
    ]


def test_cli_options_new_and_old():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = EngineConfig(**engine_kwargs(parser.parse_args(["--weight-format", "gguf", "--no-kernels"])))
    assert (config.weight_format, config.kernels) == ("gguf", False)
    with pytest.warns(DeprecationWarning):
        config = EngineConfig(**engine_kwargs(parser.parse_args(["--dtype", "q4", "--linear-backend", "panel"])))
    assert (config.weight_format, config.kernels) == ("gguf", True)


def test_serve_help_lists_every_engine_config_field_and_parses_back():
    from dataclasses import fields

    from pagedkv.entrypoints.cli import build_parser, engine_kwargs

    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    help_text = serve.format_help()
    for f in fields(EngineConfig):
        if not f.metadata.get("deprecated"):
            assert "--" + f.name.replace("_", "-") in help_text, f.name
    args = parser.parse_args(["serve", "--threads", "1", "--no-prefix-caching", "--max-num-seqs", "3"])
    kwargs = engine_kwargs(args)
    assert set(kwargs) == {f.name for f in fields(EngineConfig)}
    config = EngineConfig(**kwargs)
    assert (config.num_threads, config.enable_prefix_caching, config.max_num_seqs) == (1, False, 3)
