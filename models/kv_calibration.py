"""--calculate-kv-scales: each layer's k_scale and v_scale for an e4m3 KV cache, from the model itself.

vLLM's calculate_kv_scales takes them from a forward pass: the largest |k| over K_SCALE_CONSTANT and the largest |v|
over V_SCALE_CONSTANT of each layer, so that the values span e4m3's normal range with room above. Without them
(and without a checkpoint's) the scales are 1.0, and a layer whose values are small loses them: e4m3's smallest
normal is 2**-6 and values under 2**-9 round to zero (SmolLM2's first layer's V has a median of 0.019, 41% of it
below 2**-6). Here the pass is one calibration prompt at start-up, run layer by layer through the model in its own
dtype over a float32 pool of its own (so the K and V read back are what the model computed), before the engine's
programs are built: the scales are then fixed, as a checkpoint's would be, and every request sees the same.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import DecoderConfig
from .decoder import AttentionMetadata, RuntimeOptions, embed_phase, kv_cache_shape, layer_phase

K_SCALE_CONSTANT = 200.0     # vLLM's defaults (its envs K_SCALE_CONSTANT and V_SCALE_CONSTANT)
V_SCALE_CONSTANT = 100.0
MIN_SCALE = 2.0 ** -20       # a layer whose K or V is all zero keeps a finite scale

# Prose, code, numbers and a chat turn: the kinds of text a served model's K and V meet.
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; Neil Armstrong and Buzz "
    "Aldrin spent 21 hours and 36 minutes on its surface.\n"
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "User: What is the capital of France, and how many people live there?\n"
    "Assistant: Paris is the capital of France; about 2.1 million people live in the city itself, and over 12 "
    "million in its metropolitan area.\n"
    "Résumé: naïve café façade — 東京 is Japan's capital. Σ x_i² = 42, e^(iπ) + 1 = 0, 3.14159, 0x7fff, [1, 2, 3].")


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "options", "kind"))
def _layer(cfg, dtype, options, layer_params, h, pool, layer_idx, meta, cos, sin, kind):
    return layer_phase(cfg, dtype, options, layer_params, h, pool, layer_idx, meta, cos, sin, kind)


def kv_amax(cfg: DecoderConfig, dtype, params, token_ids: list[int], block_size: int = 16) -> np.ndarray:
    """f32[L, 2]: each layer's largest |k| and |v| over one prefill of token_ids, with the model's k_scale and
    v_scale taken as 1.0 (the pool then holds k and v themselves)."""
    n = len(token_ids)
    blocks = -(-n // block_size)
    pool = jnp.zeros(kv_cache_shape(cfg, blocks + 1, block_size), jnp.float32)      # block 0: the null block
    positions = jnp.arange(n, dtype=jnp.int32)
    meta = AttentionMetadata(positions, block_size + positions, jnp.arange(1, blocks + 1, dtype=jnp.int32)[None],
                             jnp.asarray([n], jnp.int32), jnp.asarray([0, n], jnp.int32))
    options = RuntimeOptions(attn_backend="xla", in_loop=False)

    def ones(tree):                                  # the layer's scales at 1.0: the pool holds k and v themselves
        return {**tree, "self_attn": {**tree["self_attn"], "k_scale": jnp.ones((), jnp.float32),
                                      "v_scale": jnp.ones((), jnp.float32)}}
    layers = params["layers"]
    kinds = cfg.layer_kinds()
    h, cos, sin = embed_phase(cfg, dtype, params, jnp.asarray(token_ids, jnp.int32), meta)
    for i in range(cfg.num_layers):
        lp = layers[i] if isinstance(layers, list) else jax.tree.map(lambda x, i=i: x[i], layers)
        h, pool = _layer(cfg, dtype, options, ones(lp), h, pool, jnp.int32(i), meta, cos, sin,
                         kinds[i] if kinds else None)
    return np.asarray(jnp.max(jnp.abs(pool), axis=(2, 3, 4, 5)))          # unwritten slots hold zeros


def calibrated_params(params, amax: np.ndarray):
    """params with each layer's k_scale = amax[l, 0] / K_SCALE_CONSTANT and v_scale = amax[l, 1] /
    V_SCALE_CONSTANT (at least MIN_SCALE), in the layers' layout (stacked, or a list of one tree per layer)."""
    scales = np.maximum(amax / np.asarray([K_SCALE_CONSTANT, V_SCALE_CONSTANT], np.float32), MIN_SCALE)
    layers = params["layers"]
    if isinstance(layers, list):
        return {**params, "layers": [{**lp, "self_attn": {**lp["self_attn"], "k_scale": jnp.float32(k),
                                                          "v_scale": jnp.float32(v)}}
                                     for lp, (k, v) in zip(layers, scales)]}
    return {**params, "layers": {**layers, "self_attn": {**layers["self_attn"], "k_scale": jnp.asarray(scales[:, 0]),
                                                         "v_scale": jnp.asarray(scales[:, 1])}}}
