"""KV writes: scatter this step's new K/V into the block pool by slot mapping.

  kv_cache:     dtype[L, 2, B, K, S, D]   (or e4m3 bytes, FP8_CACHE_DTYPE: values saturate at +-448; or bf16
                                         bits on the CPU, CPU_BF16_CACHE_DTYPE)
  k, v:         dtype[T, K, D]
  slot_mapping: i32[T]     slot = block_id * S + offset; padding tokens use slot 0..S-1 (the null block)

The Pallas kernel updates the pool in place (input_output_aliases): under jit with the pool donated, or
as the carry of the model's lax.scan, no copy of the pool is made. Grid (T, K): one program stores one
token's K and V rows for one kv head. Padding tokens may all hit the same null-block slot; those racing
writes are harmless because the null block is never read unmasked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._checks import check_triton_offsets, to_cache


def write_kv_reference(kv_cache, layer_idx, k, v, slot_mapping):
    """Plain-jnp scatter. Under jit with the cache donated, XLA updates the pool in place."""
    block_size = kv_cache.shape[4]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv = to_cache(jnp.stack([k, v]), kv_cache.dtype)        # [2, T, K, D]
    # Advanced indices (layer, blocks, offsets) are split by the K slice, so the scattered update is
    # laid out as [T, 2, K, D].
    return kv_cache.at[layer_idx, :, blocks, :, offsets, :].set(kv.transpose(1, 0, 2, 3))


def _write_kv_kernel(layer_ref, slot_mapping_ref, k_ref, v_ref, _cache_in_ref, cache_ref):
    # layer_ref:        i32[1]
    # slot_mapping_ref: i32[T]
    # k_ref, v_ref:     dtype[T, K, D]
    # _cache_in_ref:    dtype[L, 2, B, K, S, D]   aliased with cache_ref; not read
    # cache_ref:        dtype[L, 2, B, K, S, D]   only the T slots are written
    t, h = pl.program_id(0), pl.program_id(1)
    block_size = cache_ref.shape[4]
    layer = layer_ref[0]
    slot = slot_mapping_ref[t]
    block, offset = slot // block_size, slot % block_size
    cache_ref[layer, 0, block, h, offset, :] = to_cache(k_ref[t, h, :], cache_ref.dtype)
    cache_ref[layer, 1, block, h, offset, :] = to_cache(v_ref[t, h, :], cache_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv_pallas(kv_cache, layer_idx, k, v, slot_mapping, *, interpret: bool | None = None):
    """In-place scatter of k, v dtype[T, K, D] into kv_cache dtype[L, 2, B, K, S, D]; returns the pool."""
    if kv_cache.ndim != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [L, 2, B, K, S, D]; got {kv_cache.shape}")
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[5]
    if k.shape != v.shape or k.ndim != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k {k.shape} / v {v.shape} must both be [T, {num_kv_heads}, {head_dim}]")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be i32[{k.shape[0]}]; got {slot_mapping.dtype}"
                         f"{list(slot_mapping.shape)}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head dim {head_dim} must be a power of two")
    check_triton_offsets(kv_cache)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    layer = jnp.asarray(layer_idx, jnp.int32).reshape(1)
    return pl.pallas_call(
        _write_kv_kernel,
        grid=(k.shape[0], num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={4: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(layer, slot_mapping, k, v, kv_cache)
