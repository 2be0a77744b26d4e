"""KV writes: scatter this step's new K/V into the block pool by slot mapping.

  kv_cache:     dtype[L, 2, B, K, S, D]
  k, v:         dtype[T, K, D]
  slot_mapping: i32[T]     slot = block_id * S + offset; padding tokens use slot 0..S-1 (the null block)
"""
from __future__ import annotations

import jax.numpy as jnp


def write_kv_reference(kv_cache, layer_idx, k, v, slot_mapping):
    """Plain-jnp scatter. Under jit with the cache donated, XLA updates the pool in place."""
    block_size = kv_cache.shape[4]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv = jnp.stack([k, v]).astype(kv_cache.dtype)                 # [2, T, K, D]
    # Advanced indices (layer, blocks, offsets) are split by the K slice, so the scattered update is
    # laid out as [T, 2, K, D].
    return kv_cache.at[layer_idx, :, blocks, :, offsets, :].set(kv.transpose(1, 0, 2, 3))
