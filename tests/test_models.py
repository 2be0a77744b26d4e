"""Tiny random Llama / Qwen2 / Qwen3 models: jaxpaged's logits through the paged KV cache equal HF
transformers' (PyTorch, float32) for a prefill and several decode steps."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxpaged.models import AttentionMetadata, DecoderModel, kv_cache_shape, load_model

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False),
}
MODEL_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}


def make_hf_model(family, path):
    torch.manual_seed(0)
    model = MODEL_CLASSES[family](CONFIGS[family]()).eval()
    with torch.no_grad():   # random, non-trivial norms and biases so every weight matters
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model


class PagedRunner:
    """Drives the decoder one request at a time through a paged cache with shuffled physical blocks."""

    def __init__(self, loaded, block_size=4, num_blocks=64):
        self.cfg, self.params = loaded.config, loaded.params
        self.block_size = block_size
        self.kv = jnp.zeros(kv_cache_shape(self.cfg, num_blocks, block_size), jnp.float32)
        # Physical blocks deliberately out of order; block 0 stays the null block.
        self.block_ids = list(np.random.default_rng(1).permutation(np.arange(1, num_blocks))[:16])
        self.model = DecoderModel(self.cfg, jnp.float32)
        self.num_computed = 0

    def step(self, token_ids):
        n = len(token_ids)
        pos = np.arange(self.num_computed, self.num_computed + n)
        slots = np.array([self.block_ids[p // self.block_size] * self.block_size + p % self.block_size for p in pos])
        table = np.zeros((1, 20), np.int32)
        used = -(-(self.num_computed + n) // self.block_size)
        table[0, :used] = self.block_ids[:used]
        meta = AttentionMetadata(jnp.asarray(pos, jnp.int32), jnp.asarray(slots, jnp.int32), jnp.asarray(table),
                                 jnp.asarray([self.num_computed + n], jnp.int32), jnp.asarray([0, n], jnp.int32))
        # logits at every token, to compare the whole prefill
        logits, self.kv = self.model.apply({"params": self.params}, jnp.asarray(token_ids, jnp.int32), self.kv,
                                           meta, jnp.arange(n, dtype=jnp.int32))
        self.num_computed += n
        return np.asarray(logits)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_hf(family, tmp_path):
    hf = make_hf_model(family, tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.family == family
    runner = PagedRunner(loaded)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 320, 13).tolist()          # 13: not a multiple of the block size
    ids = list(prompt)
    ours = [runner.step(prompt)]
    for _ in range(5):
        nxt = int(np.argmax(ours[-1][-1]))
        ids.append(nxt)
        ours.append(runner.step([nxt]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = np.concatenate(ours, axis=0)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel
