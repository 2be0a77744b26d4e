"""Sizing the KV pool at start-up, as vLLM reports it: free memory after weights and the activation
peak, divided by the bytes of one block."""
from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import numpy as np

from jaxpaged import envs

logger = logging.getLogger("jaxpaged.engine")


class CacheSize(NamedTuple):
    num_blocks: int          # including the null block
    block_bytes: int
    budget_bytes: int


def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> int:
    return num_layers * 2 * num_kv_heads * block_size * head_dim * np.dtype(dtype).itemsize


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def size_kv_cache(per_block: int, weights_bytes: int, activation_bytes: int, gpu_memory_utilization: float,
                  override: int | None) -> CacheSize:
    if override is not None:
        return CacheSize(override, per_block, override * per_block)
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        budget = envs.JAXPAGED_CPU_KV_CACHE_MIB << 20
    else:
        # bytes_limit is what XLA's allocator may use; bytes_in_use already holds the weights.
        total = stats.get("bytes_reservable_limit", stats["bytes_limit"])
        budget = int(total * gpu_memory_utilization) - stats.get("bytes_in_use", weights_bytes) - activation_bytes
    num_blocks = max(budget // per_block, 0)
    if num_blocks < 2:
        raise ValueError(f"No memory left for the KV cache (budget {budget / 2**30:.2f} GiB after weights "
                         f"{weights_bytes / 2**30:.2f} GiB): raise gpu_memory_utilization or lower max_model_len")
    return CacheSize(int(num_blocks), per_block, budget)
