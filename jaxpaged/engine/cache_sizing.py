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


# Copies of a chunk's [rows, V] float32 logits a variant's sampler holds at once (runner/sampler.py
# SAMPLER_CHUNK_BYTES), and of the prompt-logprob head's chunk (models/decoder.py prompt_chunk_rows), with room to
# spare: XLA's memory analysis of gemma-2-9b's largest step on the H100 put the prompt head at about six
# (bench/temporaries.py; bench/results/NOTES.md).
SAMPLER_CHUNK_COPIES = 10
PROMPT_CHUNK_COPIES = 10


def activation_reserve(cfg, max_tokens: int, max_seqs: int, dtype) -> int:
    """Bytes kept free beside the weights and the pool for the step programs' temporaries, the larger of
    - the layers at max_tokens tokens: the MLP's gate/up output and product, the residual stream and the norms'
      float32 intermediates, q/k/v, and one layer's weights in the compute dtype (a scan's slice of the stacked
      weights, or a quantized layer expanded for a prefill's dot), and
    - the head at max_seqs rows: the sampled rows' float32 logits twice (the head's and the sampler's result)
      and the larger of a variant's sampler chunk and the prompt-logprob head's chunk (the larger, not both: the
      prompt head runs before the sampled rows' logits exist, models/decoder.py rows_after_prompt_head),
    plus slack for XLA. The pool is sized before anything compiles; the warm-up logs what the programs take."""
    from jaxpaged.models.decoder import prompt_chunk_rows
    from jaxpaged.runner.sampler import SAMPLER_CHUNK_BYTES
    item = max(np.dtype(dtype).itemsize, 2)
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, qkv = cfg.num_heads * cfg.head_dim, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    layer_weights = (h * (qkv + 2 * inter) + (q + inter) * h) * item
    layers = max_tokens * (3 * inter + 6 * h + qkv) * item + layer_weights
    sampler_chunk = min(SAMPLER_CHUNK_BYTES or max_seqs * vocab * 4, max_seqs * vocab * 4)
    prompt_chunk = min(prompt_chunk_rows(vocab), max_tokens) * vocab * 4
    head = 2 * max_seqs * vocab * 4 + max(SAMPLER_CHUNK_COPIES * sampler_chunk, PROMPT_CHUNK_COPIES * prompt_chunk)
    return max(layers, head) + (256 << 20)


def _stable_round(num_blocks: int) -> int:
    """Round the block count down to a coarse step (under 1% of the pool).

    The pool's shape is part of every compiled step, so a count that wobbles with a few MiB of measured
    memory would miss the persistent compilation cache on every restart.
    # 197407 -> step 1024 -> 196608
    """
    step = 1
    while step * 2 * 128 <= num_blocks:
        step *= 2
    return num_blocks // step * step


def size_kv_cache(per_block: int, weights_bytes: int, activation_bytes: int, gpu_memory_utilization: float,
                  override: int | None, itemsize: int = 2) -> CacheSize:
    """itemsize: bytes of one pool value (1 for an e4m3 pool, which is kept out of the 2-4 GiB sizes JAX's Triton
    kernels cannot address: pallas_kernels.pool_blocks_outside_window)."""
    from jaxpaged.pallas_kernels import pool_blocks_outside_window
    if override is not None:
        if pool_blocks_outside_window(override, per_block, itemsize) != override:
            raise ValueError(f"num_gpu_blocks_override {override} makes a pool of {override * per_block / 2**30:.2f} "
                             "GiB of 1-byte values, inside the 2-4 GiB that JAX's Triton kernels cannot address: "
                             f"choose at most {2**31 // per_block} blocks or more than {2**32 // per_block}")
        return CacheSize(override, per_block, override * per_block)
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        budget = envs.JAXPAGED_CPU_KV_CACHE_MIB << 20
    else:
        # bytes_limit is what XLA's allocator may use: XLA_PYTHON_CLIENT_MEM_FRACTION of the device's
        # memory. gpu_memory_utilization is a fraction of the whole device, as in vLLM, capped by that
        # limit; bytes_in_use already holds the weights.
        limit = stats["bytes_limit"]
        device_total = limit / envs.XLA_MEM_FRACTION
        usable = min(int(device_total * gpu_memory_utilization), limit)
        budget = usable - stats.get("bytes_in_use", weights_bytes) - activation_bytes
        logger.info("Device memory: %.1f GiB, allocator limit %.1f GiB, in use %.2f GiB, activations %.2f GiB",
                    device_total / 2**30, limit / 2**30, stats.get("bytes_in_use", 0) / 2**30,
                    activation_bytes / 2**30)
    num_blocks = _stable_round(max(budget // per_block, 0))
    capped = pool_blocks_outside_window(num_blocks, per_block, itemsize)
    if capped != num_blocks:
        logger.warning("KV cache: %d blocks (%.2f GiB of 1-byte values) cut to %d (2 GiB): JAX's Triton kernels "
                       "address a pool of 2-4 GiB with 32-bit offsets that cannot reach its end",
                       num_blocks, num_blocks * per_block / 2**30, capped)
        num_blocks = capped
    if num_blocks < 2:
        raise ValueError(f"No memory left for the KV cache (budget {budget / 2**30:.2f} GiB after weights "
                         f"{weights_bytes / 2**30:.2f} GiB and activations {activation_bytes / 2**30:.2f} GiB; "
                         f"device memory stats {stats}): raise gpu_memory_utilization")
    return CacheSize(int(num_blocks), per_block, budget)
