"""Flax model definitions and loaders (installed as jaxpaged.models).

The names below load on first use (PEP 562): a process that needs only a light submodule (gguf_convert, to find
or convert the model folder) does not import JAX and Flax with it. The API processes of the server are such
processes: the engine core, in its own process, is the one that runs the model."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:                      # what the names are, for type checkers (at run time: __getattr__)
    from .config import SUPPORTED_ARCHITECTURES, DecoderConfig, UnsupportedArchitectureError, decoder_config_from_hf
    from .decoder import AttentionMetadata, DecoderModel, RuntimeOptions, kv_cache_dtype, kv_cache_shape
    from .loader import LoadedModel, load_model, read_hf_config

_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": "config", "DecoderConfig": "config", "UnsupportedArchitectureError": "config",
    "decoder_config_from_hf": "config",
    "AttentionMetadata": "decoder", "DecoderModel": "decoder", "RuntimeOptions": "decoder",
    "kv_cache_dtype": "decoder", "kv_cache_shape": "decoder",
    "LoadedModel": "loader", "load_model": "loader", "read_hf_config": "loader",
}

__all__ = ["SUPPORTED_ARCHITECTURES", "AttentionMetadata", "DecoderConfig", "DecoderModel", "LoadedModel",
           "RuntimeOptions", "UnsupportedArchitectureError", "decoder_config_from_hf", "kv_cache_dtype",
           "kv_cache_shape", "load_model", "read_hf_config"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
