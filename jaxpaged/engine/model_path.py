"""Which folder a model argument names: the folder itself, the converted folder of a GGUF file, or the embedded
SmolLM2-135M-Instruct's. Light on imports: the server's API processes call it before the engine core starts."""
from __future__ import annotations

import os

from jaxpaged import envs


def resolve_model_path(model: str | None, quantization: str | None = None) -> str:
    """The model folder: the given one; for a GGUF file (as vLLM's --model file.gguf), its HF folder in the
    cache (converted on first use, its tokenizer from the file); or the embedded SmolLM2-135M-Instruct.
    Under quantization="gguf" the folder need not hold the weights as float32 (the loader reads the file)."""
    weights = quantization != "gguf"
    if model is None:
        from jaxpaged.models.gguf_convert import default_model_dir
        return str(default_model_dir(envs.JAXPAGED_CACHE_ROOT / "models", weights))
    if model.endswith(".gguf") and os.path.isfile(model):
        from jaxpaged.models.gguf_convert import gguf_model_dir
        return str(gguf_model_dir(model, envs.JAXPAGED_CACHE_ROOT / "models", weights))
    return model
