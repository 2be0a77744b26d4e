"""Pallas GPU kernels for paged attention, with plain-jnp references.

This package imports nothing from the rest of jaxpaged. The model calls only `attention` and `write_kv`;
which implementation runs below them is chosen by `backend`:

  "reference"  plain jnp (the `*_reference` functions, memory-hungry; tests only)
  "xla"        chunked online-softmax jnp (CPU default, GPU fallback)
  "pallas"     Pallas GPU kernels on the Triton backend (the default on GPUs other than Hopper)
  "mosaic"     as "pallas", but the ragged (prefill / mixed) attention runs the persistent Mosaic GPU kernel
               for Hopper (ragged_paged_attention_mgpu.py: TMA, wgmma, warp specialisation) wherever it
               supports the call (bf16/fp16, head dim 64/128, no window or soft cap; ALiBi), the Triton
               kernel elsewhere. The default on Hopper (sm_90): on the H100 it runs prefill about as fast as
               cuDNN's dense attention, well ahead of the Triton kernel, and that shows end to end.
               Decode batches of at least MOSAIC_DECODE_MIN_PAIRS (request, kv head) pairs outside while
               loops (per-layer or unrolled dispatch, one step per program) run the Mosaic decode kernel
               (paged_decode_attention_mgpu), or where it declines a soft cap, a sliding window or head size
               256 (Gemma 2 and 3), the wide-head one (paged_decode_attention_mgpu_wide); other decodes the
               Triton split-K one. Mixed batches outside while loops run their one-token requests in the
               packed decode kernel and the rest in the ragged one (mixed_attention_mgpu), where both take
               the layout. Over an e4m3 pool:
               the Mosaic decode kernel from head size MOSAIC_FP8_DECODE_MIN_HEAD_DIM (with
               MOSAIC_FP8_DECODE_CONFIG: both compute warpgroups widen the slots), the Triton prefill kernel.

The caller names the backend (jaxpaged.config.resolve picks it by platform: "xla" on the CPU, "mosaic"
on Hopper, "pallas" on other GPUs); this package reads no environment and makes no configuration choice.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ._checks import (CPU_BF16_CACHE_DTYPE, FP8_CACHE_DTYPE, cache_values_dtype, dot_precision, in_triton_32bit_window,
                      is_hopper, pool_blocks_outside_window)
from .kv_write import write_kv_pallas, write_kv_reference
from .paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from .ragged_paged_attention import ragged_paged_attention_reference, ragged_paged_attention_xla
from .ragged_paged_attention_pallas import ragged_paged_attention_pallas

BACKENDS = ("reference", "xla", "pallas", "mosaic")
# Decode batches of at least this many (request, kv head) pairs run the Mosaic GPU decode kernel
# (paged_decode_attention_mgpu: persistent CTAs over pairs, no split-K) under backend "mosaic", outside
# while loops (attention's in_loop).
# Why 128: one pair per SM (the H100 has 132) is where the persistent kernel has the machine to itself.
# From there on it is faster than the Triton split-K decode kernel on the H100 on every measured shape;
# below it slower, since without split-K a few dozen CTAs leave most SMs idle (16 qwen2-0.5b requests are
# 32 pairs).
MOSAIC_DECODE_MIN_PAIRS = 128
# The wide-head Mosaic decode kernel (paged_decode_attention_mgpu_wide) takes, from the same pair count, the bf16
# decodes the packed one declines: head size 256, soft caps, sliding windows. At gemma-2-9b's layout (head size
# 256, soft cap 50) it read K/V at 1.65-1.79x the Triton decode kernel's rate (H200, 64 x 1k to 256 x 4k), and
# at llama3-8b's it ran as fast as the packed kernel, which keeps those calls.
# Over an e4m3 pool the Mosaic decode kernel widens every K/V slot to float16 in its one busy compute
# warpgroup, so it is no longer bound by bytes alone: on the H100 it beat the Triton decode kernel on the same
# pool for head size 128 (llama3-8b 64 x 4k: 324 against 357 us) and lost for 64 (qwen2-0.5b, whose seven
# query heads a kv head make the tile's softmax the larger share: 62 against 54 us at 64 x 4k, 208 against 180
# at 256 x 4k). Prefill over an e4m3 pool keeps to the Triton kernel: there both compute warpgroups would widen
# every slot, and the Mosaic kernel was not shown faster.
MOSAIC_FP8_DECODE_MIN_HEAD_DIM = 128
# How the Mosaic decode kernel reads an e4m3 pool: split_keys gives each pair's key steps to both compute
# warpgroups in turn (each widens half the slots), with 64-key steps (what split_keys takes) and three in
# flight. On the H100 at llama3-8b's layout: 64 x 4k 259 us and 256 x 4k 1,000 us, against 325 and 1,251 us
# for one widening warpgroup and 334 and 1,255 us for the Triton kernel's best configuration. A bf16 pool is
# bound by bytes and gains nothing from it (368 against 369 us at 64 x 4k), so keeps the default.
MOSAIC_FP8_DECODE_CONFIG = {"block_kv": 64, "max_concurrent_steps": 3, "split_keys": True}

__all__ = ["BACKENDS", "CPU_BF16_CACHE_DTYPE", "FP8_CACHE_DTYPE", "attention", "cache_values_dtype", "dot_precision",
           "in_triton_32bit_window", "is_hopper", "pool_blocks_outside_window",
           "paged_decode_attention", "paged_decode_attention_reference", "ragged_paged_attention_reference",
           "ragged_paged_attention_xla", "write_kv", "write_kv_reference"]


def attention(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *, scale: float,
              decode_only: bool = False, in_loop: bool = False, sliding_window: int | None = None,
              soft_cap: float | None = None, backend: str = "xla", interpret: bool | None = None,
              num_sms: int | None = None, kv_scales=None, alibi_slopes=None):
    """Attention of a flat ragged batch over the paged cache; see ragged_paged_attention.py for shapes.

    decode_only: static promise that every request has exactly one query token (T == R), which lets the
    decode kernel run instead of the ragged one.
    in_loop: static; the call sits in the body of a loop that XLA runs as a while loop (a scan over layers
    or over decode steps). Decodes there keep to the Triton decode kernel: XLA does not capture the Mosaic
    GPU custom call in the CUDA graphs it launches a loop body's kernels with, so every kernel of the body
    would launch on its own: a multi-step decode program then spends about twice as long being launched
    by the host as with the Triton kernel. The Mosaic prefill kernel stays: a prefill step's kernels are
    long enough that the uncaptured launches don't show.
    interpret: run the Pallas kernels in interpret mode (None: when JAX's default backend is the CPU);
    num_sms: the GPU's SM count the kernels size their grids by (None: the device's own). Callers that
    lower for a GPU from a process without one (the engine's lowering workers) name both.
    kv_scales: (k_scale, v_scale) f32[] for an e4m3 cache (FP8_CACHE_DTYPE), whose K/V hold k / k_scale and
    v / v_scale (write_kv): the scores take k_scale through q and the output v_scale, so the kernels only
    convert each tile to q's dtype (the Mosaic decode kernel, from head size MOSAIC_FP8_DECODE_MIN_HEAD_DIM: to
    float16, and computes in it).
    alibi_slopes: f32[N] or None: ALiBi's bias slope[n] * (key position - query position) on head n's
    scores (the Mosaic decode kernel takes it with one query head per kv head, as ALiBi models have).
    """
    if kv_scales is None:
        return _attention(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, scale=scale,
                          decode_only=decode_only, in_loop=in_loop, sliding_window=sliding_window,
                          soft_cap=soft_cap, backend=backend, interpret=interpret, num_sms=num_sms,
                          alibi_slopes=alibi_slopes)
    k_scale, v_scale = kv_scales
    out = _attention((q * k_scale).astype(q.dtype), kv_cache, layer_idx, block_tables, seq_lens, query_start_loc,
                     scale=scale, decode_only=decode_only, in_loop=in_loop, sliding_window=sliding_window,
                     soft_cap=soft_cap, backend=backend, interpret=interpret, num_sms=num_sms,
                     alibi_slopes=alibi_slopes)
    return (out * v_scale).astype(q.dtype)


def _attention(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *, scale, decode_only, in_loop,
               sliding_window, soft_cap, backend, interpret, num_sms, alibi_slopes):
    if backend == "reference":
        return ragged_paged_attention_reference(q, kv_cache, layer_idx, block_tables, seq_lens,
                                                query_start_loc, scale=scale, sliding_window=sliding_window,
                                                soft_cap=soft_cap, alibi_slopes=alibi_slopes)
    if backend == "xla":
        return ragged_paged_attention_xla(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc,
                                          scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                          alibi_slopes=alibi_slopes)
    if backend in ("pallas", "mosaic"):
        # On the CPU "mosaic" runs the Triton kernels (interpreted) like "pallas": the Mosaic GPU
        # interpreter runs the kernel on its own (tests/kernels/test_mosaic_gpu.py), but inside the engine's
        # jitted step jax 0.10.2 fails to lower it (safe_zip length mismatch in lower_jaxpr_to_fun).
        if interpret is None:
            interpret = jax.default_backend() == "cpu"
        mosaic = backend == "mosaic" and not interpret
        fp8 = kv_cache.dtype == FP8_CACHE_DTYPE
        if decode_only:
            if (mosaic and not in_loop and q.shape[0] * kv_cache.shape[3] >= MOSAIC_DECODE_MIN_PAIRS
                    and not (fp8 and q.shape[-1] < MOSAIC_FP8_DECODE_MIN_HEAD_DIM)):
                from .paged_decode_attention_mgpu import mgpu_decode_supported, paged_decode_attention_mgpu
                if mgpu_decode_supported(q, kv_cache, sliding_window=sliding_window, soft_cap=soft_cap,
                                         alibi=alibi_slopes is not None) is None:
                    return paged_decode_attention_mgpu(q, kv_cache, layer_idx, block_tables, seq_lens,
                                                       scale=scale, num_ctas=num_sms, alibi_slopes=alibi_slopes,
                                                       interpret=False, **(MOSAIC_FP8_DECODE_CONFIG if fp8 else {}))
                # what the packed kernel declines: head size 256, soft caps, windows (Gemma 2 and 3, Mistral)
                from . import paged_decode_attention_mgpu_wide as wide
                if wide.mgpu_wide_decode_supported(q, kv_cache, alibi=alibi_slopes is not None) is None:
                    return wide.paged_decode_attention_mgpu_wide(q, kv_cache, layer_idx, block_tables, seq_lens,
                                                                 scale=scale, sliding_window=sliding_window,
                                                                 soft_cap=soft_cap, num_ctas=num_sms,
                                                                 interpret=False)
            return paged_decode_attention(q, kv_cache, layer_idx, block_tables, seq_lens, scale=scale,
                                          sliding_window=sliding_window, soft_cap=soft_cap,
                                          alibi_slopes=alibi_slopes, interpret=interpret, num_sms=num_sms)
        if mosaic and not fp8:
            # imported here: only this backend needs Mosaic GPU's Pallas module
            from .ragged_paged_attention_mgpu import mgpu_supported, ragged_paged_attention_mgpu
            if mgpu_supported(q, kv_cache, kv_cache.shape[4], sliding_window=sliding_window,
                              soft_cap=soft_cap) is None:
                from .paged_decode_attention_mgpu import mgpu_decode_supported, mixed_attention_mgpu
                if not in_loop and mgpu_decode_supported(q, kv_cache, alibi=alibi_slopes is not None) is None:
                    # A mixed step's decodes in the packed decode kernel, its prompt chunks in the ragged one, at any
                    # decode count (no MOSAIC_DECODE_MIN_PAIRS): the ragged kernel alone gives each decode a tile per
                    # query head, slower on the H100 from 128 decodes (llama3-8b, 128 x 256 beside 56 prompts of 256:
                    # 214 against 271 us a layer; 900 decodes: 530 against 1,038 us).
                    return mixed_attention_mgpu(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc,
                                                scale=scale, num_ctas=num_sms, alibi_slopes=alibi_slopes,
                                                interpret=False)
                return ragged_paged_attention_mgpu(q, kv_cache, layer_idx, block_tables, seq_lens,
                                                   query_start_loc, scale=scale, num_ctas=num_sms,
                                                   alibi_slopes=alibi_slopes, interpret=False)
        return ragged_paged_attention_pallas(q, kv_cache, layer_idx, block_tables, seq_lens,
                                             query_start_loc, scale=scale,
                                             sliding_window=sliding_window, soft_cap=soft_cap,
                                             alibi_slopes=alibi_slopes, interpret=interpret)
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


def write_kv(kv_cache, layer_idx, k, v, slot_mapping, *, backend: str = "xla", interpret: bool | None = None,
             kv_scales=None):
    """Scatter new K/V (dtype[T, K, D]) into the pool at slot_mapping (i32[T]); returns the pool.
    interpret: as attention's; kv_scales: (k_scale, v_scale) of an e4m3 pool, which stores k / k_scale and
    v / v_scale."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if kv_scales is not None:
        # in float32 by the float32 scales attention multiplies back by: one rounding, to e4m3, in to_cache
        k, v = k.astype(jnp.float32) / kv_scales[0], v.astype(jnp.float32) / kv_scales[1]
    if backend in ("pallas", "mosaic"):
        return write_kv_pallas(kv_cache, layer_idx, k, v, slot_mapping, interpret=interpret)
    return write_kv_reference(kv_cache, layer_idx, k, v, slot_mapping)
