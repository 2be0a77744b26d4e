import os

# Tests run on the CPU; keep XLA to a predictable thread count on small CI machines.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
