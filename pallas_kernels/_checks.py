"""Input checks shared by the attention kernels' public ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# The one narrower cache the kernels read (--kv-cache-dtype fp8): e4m3 values, held as their bytes (uint8)
# and reinterpreted where read. Why bytes: XLA's CPU backend widens every op on an e4m3 (or bf16) array to
# f32, so each step's scatter into an e4m3 pool converted and copied the whole pool (~1 s a layer on a
# 0.5 GiB pool; a uint8 scatter is in place); on the GPU the reinterpretation is free. Each K/V tile is
# converted to q's dtype as it is loaded; the per-layer scales are the caller's (pallas_kernels.attention).
FP8_CACHE_DTYPE = jnp.uint8
FP8_MAX = 448.0          # e4m3fn's largest finite value: writes saturate there
# A bf16 pool on the CPU, for the same reason: its bf16 values held as their bits (uint16), since XLA:CPU
# widens the step's ops on a bf16 pool to f32 over the whole pool (SmolLM2, 512 MiB pool: 5.7 s a step
# instead of 0.26 s). On GPUs the pool is bf16.
CPU_BF16_CACHE_DTYPE = jnp.uint16


# What each held dtype's bytes stand for; every other pool dtype holds its own values.
_HELD_VALUES = {jnp.dtype(FP8_CACHE_DTYPE): jnp.dtype(jnp.float8_e4m3fn),
                jnp.dtype(CPU_BF16_CACHE_DTYPE): jnp.dtype(jnp.bfloat16)}


def dot_precision(dtype):
    """A dot's precision for operands of dtype: HIGHEST for float32, so that float32 math stays float32 (at XLA's
    default, Ampere and later GPUs run a float32 dot as TF32: 10 mantissa bits); the default for other dtypes."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def cache_values_dtype(cache_dtype):
    """The dtype of the values a pool of cache_dtype holds (its own, or what its bytes or bits stand for)."""
    return _HELD_VALUES.get(jnp.dtype(cache_dtype), jnp.dtype(cache_dtype))


def from_cache(x, dtype):
    """Cache values (a loaded tile, or gathered blocks) in dtype: held bytes or bits are reinterpreted first."""
    values = cache_values_dtype(x.dtype)
    if values != x.dtype:
        x = jax.lax.bitcast_convert_type(x, values)
    return x.astype(dtype)


def to_cache(x, cache_dtype):
    """K/V values in the pool's dtype; into e4m3 they saturate at its largest value (no NaN from overflow)."""
    values = cache_values_dtype(cache_dtype)
    if values == jnp.float8_e4m3fn:
        x = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    x = x.astype(values)
    return x if values == jnp.dtype(cache_dtype) else jax.lax.bitcast_convert_type(x, cache_dtype)


# JAX's Pallas Triton lowering addresses an operand with signed 32-bit offsets unless the operand holds more
# than 2**32 bytes, so a 1-byte array of more than 2**31 and at most 2**32 bytes (an e4m3 pool of 2-4 GiB) has
# elements its offsets cannot reach: the Triton kernels read garbage from its last blocks (NaN in e4m3, seen on
# the H100 with jax 0.11.2) and would write there likewise. Wider dtypes cross 2**31 elements only past 2**32
# bytes, where the offsets are 64-bit. 1-byte pools stay out of this window (pool_blocks_outside_window).
_TRITON_32BIT_WINDOW = (2**31, 2**32)


def in_triton_32bit_window(nbytes: int, itemsize: int) -> bool:
    """A 1-byte array of this size has elements past the 32-bit offsets JAX's Triton lowering gives it."""
    return itemsize == 1 and _TRITON_32BIT_WINDOW[0] < nbytes <= _TRITON_32BIT_WINDOW[1]


def pool_blocks_outside_window(num_blocks: int, block_bytes: int, itemsize: int) -> int:
    """num_blocks, or for a pool of 1-byte values inside the window, the most blocks that keep it to 2**31
    bytes (the window's lower edge; its upper edge would need more memory than the pool was given)."""
    if in_triton_32bit_window(num_blocks * block_bytes, itemsize):
        return _TRITON_32BIT_WINDOW[0] // block_bytes
    return num_blocks


def check_triton_offsets(kv_cache) -> None:
    """ValueError for a pool the Triton kernels cannot address (in_triton_32bit_window)."""
    if in_triton_32bit_window(kv_cache.size * kv_cache.dtype.itemsize, kv_cache.dtype.itemsize):
        raise ValueError(f"a {kv_cache.dtype} pool of {kv_cache.size} bytes (over 2 GiB, at most 4 GiB) has elements "
                         "past the 32-bit offsets JAX's Triton lowering uses below 4 GiB; size it to at most "
                         "2**31 bytes or past 2**32 (pool_blocks_outside_window)")


def validate_q_and_cache(q, kv_cache, layer_idx) -> None:
    """Shared checks of a query batch against the pool layout [L, 2, B, K, S, D]."""
    if q.ndim != 3 or kv_cache.ndim != 6:
        raise ValueError(f"expected q[T, N, D] and kv_cache[L, 2, B, K, S, D]; got {q.shape}, "
                         f"{kv_cache.shape}")
    _, num_heads, head_dim = q.shape
    _, two, _, num_kv_heads, block_size, cache_dim = kv_cache.shape
    if two != 2 or cache_dim != head_dim:
        raise ValueError(f"kv_cache {kv_cache.shape} does not match q {q.shape}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if block_size not in (8, 16, 32, 64) or head_dim not in (64, 128, 256):
        raise ValueError(f"block size {block_size} / head dim {head_dim} unsupported "
                         "(block sizes 8/16/32/64, head dims 64/128/256)")
    if jnp.shape(layer_idx) not in ((), (1,)):
        raise ValueError(f"layer_idx must be a scalar; got shape {jnp.shape(layer_idx)}")
    if q.dtype != kv_cache.dtype and kv_cache.dtype != FP8_CACHE_DTYPE:
        raise ValueError(f"q dtype {q.dtype} differs from kv_cache dtype {kv_cache.dtype} (a cache of another "
                         f"dtype than q's must be {FP8_CACHE_DTYPE})")


def is_hopper(device) -> bool:
    """A CUDA device of compute capability 9.x (what the Mosaic GPU kernel's wgmma needs)."""
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")
