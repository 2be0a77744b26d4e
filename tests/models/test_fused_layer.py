"""A decoder layer of a few rows through the fused linear kernels (pallas_kernels/fused_linear.py) against the
same layer unfused (XLA's matmuls and the XLA attention path), float32: the new hidden state and the KV pool
agree, for Llama's layer, Qwen2's q/k/v bias, ALiBi (no RoPE), a sliding window and an e4m3 pool. Interpret mode
on the CPU. Which layers take the fused path is pinned too. The end-to-end check (greedy tokens through the
engine, fused decode steps beside chunked prefills): tests/models/test_attention_backends_e2e.py."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import decoder
from jaxpaged.models.config import decoder_config_from_hf
from jaxpaged.models.decoder import AttentionMetadata, DecoderLayer, RuntimeOptions, fused_layer_ok, layer_phase

BLOCK, BLOCKS = 8, 16


def config(**overrides):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=256, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               max_position_embeddings=256)
    return decoder_config_from_hf({**cfg, **overrides})


CONFIGS = {
    "llama": config(),
    "qwen2-bias": config(architectures=["Qwen2ForCausalLM"]),
    "alibi": config(architectures=["BaichuanForCausalLM"], num_key_value_heads=4),
    "window": config(architectures=["MistralForCausalLM"], sliding_window=12),
    "fp8-pool": dataclasses.replace(config(), kv_cache_dtype="fp8"),
}


def inputs(cfg, seed: int):
    """Random layer params (norm scales and biases off their defaults), a pool with history, and 3 decode rows
    of 5, 20 and 33 tokens of context."""
    rng = np.random.default_rng(seed)
    lens = np.array([5, 20, 33], np.int32)
    tables = np.arange(3 * 5, dtype=np.int32).reshape(3, 5)
    pos = lens - 1
    meta = AttentionMetadata(positions=jnp.asarray(pos), slot_mapping=jnp.asarray(tables[np.arange(3), pos // BLOCK]
                                                                                     * BLOCK + pos % BLOCK),
                             block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(lens),
                             query_start_loc=jnp.arange(4, dtype=jnp.int32))
    h = jnp.asarray(rng.standard_normal((3, cfg.hidden_size)), jnp.float32)
    pool_shape = decoder.kv_cache_shape(cfg, BLOCKS, BLOCK)
    pool_dtype = decoder.kv_cache_dtype(cfg, jnp.float32, "cpu")
    pool = jnp.asarray(rng.standard_normal(pool_shape) * 0.5, jnp.float32).astype(pool_dtype)
    cos, sin = decoder.rope_cos_sin(cfg, meta)
    shapes = jax.eval_shape(DecoderLayer(cfg, jnp.float32, RuntimeOptions()).init, jax.random.PRNGKey(0),
                            (h, pool, jnp.int32(0)), meta, cos, sin)["params"]
    # norm scales and biases near 1 and 0.1-wide weights: every operand matters, no value saturates
    params = jax.tree.map(lambda s: jnp.asarray(rng.uniform(0.5, 1.5, s.shape) if len(s.shape) <= 1
                                                else rng.standard_normal(s.shape) * 0.1, s.dtype), shapes)
    return params, h, pool, meta, cos, sin


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_layer_equals_the_unfused_one(name):
    cfg = CONFIGS[name]
    params, h, pool, meta, cos, sin = inputs(cfg, seed=len(name))
    fused_opts = RuntimeOptions("pallas", decode_only=True, interpret=True)
    assert fused_layer_ok(cfg, fused_opts, 3)
    got_h, got_pool = layer_phase(cfg, jnp.float32, fused_opts, params, h, pool, 1, meta, cos, sin)
    want_h, want_pool = layer_phase(cfg, jnp.float32, RuntimeOptions("xla", decode_only=True), params, h, pool, 1,
                                    meta, cos, sin)
    np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_pool[0]), np.asarray(want_pool[0]))     # layer 0 untouched
    np.testing.assert_allclose(np.asarray(got_pool[1].astype(jnp.float32)),
                               np.asarray(want_pool[1].astype(jnp.float32)), rtol=1e-5, atol=1e-5)


def test_which_layers_run_fused():
    opts = RuntimeOptions("pallas", decode_only=True)
    llama = CONFIGS["llama"]
    assert fused_layer_ok(llama, opts, 1) and fused_layer_ok(llama, opts, decoder.FUSED_LAYER_MAX_ROWS)
    assert not fused_layer_ok(llama, opts, decoder.FUSED_LAYER_MAX_ROWS + 1)       # XLA's matmuls from there
    assert not fused_layer_ok(llama, RuntimeOptions("xla", decode_only=True), 1)    # the kernels do not run
    assert not fused_layer_ok(dataclasses.replace(llama, weight_quant=(("o_proj", "int4-g128"),)), opts, 1)
    assert not fused_layer_ok(config(architectures=["Qwen3ForCausalLM"]), opts, 1)       # q/k norms
    assert not fused_layer_ok(config(architectures=["Gemma2ForCausalLM"]), opts, 1)      # four norms
    assert not fused_layer_ok(config(num_attention_heads=16, num_key_value_heads=2), opts, 1)  # head dim 16 < 32
    assert not fused_layer_ok(config(architectures=["GlmForCausalLM"], partial_rotary_factor=0.5), opts, 1)
