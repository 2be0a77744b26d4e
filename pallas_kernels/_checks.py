"""Input checks shared by the attention kernels' public ops."""
from __future__ import annotations

import jax.numpy as jnp


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
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from kv_cache dtype {kv_cache.dtype}")


def is_hopper(device) -> bool:
    """A CUDA device of compute capability 9.x (what the Mosaic GPU kernel's wgmma needs)."""
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")
