"""Flax model definitions and loaders (installed as jaxpaged.models)."""
from .config import SUPPORTED_ARCHITECTURES, DecoderConfig, UnsupportedArchitectureError, decoder_config_from_hf
from .decoder import AttentionMetadata, DecoderModel, RuntimeOptions, kv_cache_dtype, kv_cache_shape
from .loader import LoadedModel, load_model, read_hf_config

__all__ = ["SUPPORTED_ARCHITECTURES", "AttentionMetadata", "DecoderConfig", "DecoderModel", "LoadedModel",
           "RuntimeOptions", "UnsupportedArchitectureError", "decoder_config_from_hf", "kv_cache_dtype",
           "kv_cache_shape", "load_model", "read_hf_config"]
