"""Paged decode attention on the persistent Mosaic GPU kernel (Hopper), GQA heads packed into one tile.

The ragged Mosaic GPU kernel (ragged_paged_attention_mgpu.py) runs (tile of query tokens, query head)
items, so on a decode batch each of a group's G query heads would stream the request's K/V again (a
fraction of the Triton decode kernel's bandwidth on the H100). Here the batch is re-labelled so that one
item holds the G heads of one (request, kv head) pair as G rows of a tile, and K/V are streamed once per
pair, as in the Triton decode kernel:

  q        [R, N, D]              -> [R * K * G, 1, D]      (a free reshape: N = K * G, heads of a kv head
                                                             are adjacent), "request" i = r * K + h
  kv_cache [L, 2, B, K, S, D]     -> [L, 2, B * K, 1, S, D] (free: block b of kv head h is row b * K + h)
  tables   [R, M]                 -> [R * K, M]             entry tables[r, j] * K + h
  seq_lens [R]                    -> [R * K]                and query_start_loc = G * arange(R * K + 1)

with the kernel's causal mask off (every row sees the request's seq_lens[r] keys). A padding request
(seq_lens 0) gets no key steps and its rows are written as zeros. No split-K: the persistent CTAs take
(request, kv head) items, so this suits batches with at least about one pair per SM.

On the H100, from about one pair per SM (MOSAIC_DECODE_MIN_PAIRS) it is faster than the Triton decode
kernel on every measured shape, and slower below it. attention() takes it from MOSAIC_DECODE_MIN_PAIRS
pairs, outside while loops only (its custom call keeps XLA from capturing a loop body in CUDA graphs).

mixed_attention_mgpu runs a mixed batch (prompt chunks beside decodes) as two calls: the requests of one
query token through this packed kernel, the rest through the ragged kernel, which otherwise gives each
decode row a tile per query head and streams its K/V once per head of a group.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .paged_decode_attention import validate_decode_inputs
from .ragged_paged_attention_mgpu import mgpu_supported, ragged_paged_attention_mgpu


def mgpu_decode_supported(q, kv_cache, *, sliding_window=None, soft_cap=None, alibi=False) -> str | None:
    """None when paged_decode_attention_mgpu takes this call, else the reason (callers fall back)."""
    group = q.shape[1] // kv_cache.shape[3]
    if group > 64:
        return f"{group} query heads per kv head: more than one 64-row tile"
    if alibi and group > 1:
        return "ALiBi with grouped queries: a packed tile's rows would need one slope each"
    return mgpu_supported(q, kv_cache, kv_cache.shape[4], sliding_window=sliding_window, soft_cap=soft_cap)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "max_concurrent_steps", "num_ctas",
                                             "split_keys", "interpret"))
def paged_decode_attention_mgpu(q, kv_cache, layer_idx, block_tables, seq_lens, *, scale: float,
                                block_kv: int = 128, max_concurrent_steps: int = 2,
                                num_ctas: int | None = None, alibi_slopes=None, split_keys: bool = False,
                                interpret=None):
    """Same contract as paged_decode_attention: q dtype[R, N, D] -> dtype[R, N, D] (bf16/fp16 over a cache of q's
    dtype or e4m3, D 64/128, G = N // K <= 64; no sliding window or soft cap: mgpu_decode_supported says where it
    applies; ALiBi (alibi_slopes f32[N]) only with one query head per kv head). split_keys: the two compute
    warpgroups share each pair's key steps (ragged_paged_attention_mgpu)."""
    validate_decode_inputs(q, kv_cache, layer_idx, block_tables, seq_lens)
    num_reqs, num_heads, head_dim = q.shape
    num_layers, _, num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    reason = mgpu_decode_supported(q, kv_cache, alibi=alibi_slopes is not None)
    if reason:
        raise ValueError(reason)
    pairs = num_reqs * num_kv_heads
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)
    tables = (block_tables[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(pairs, -1)
    # pair r * K + h holds query head h (G = 1 with ALiBi): its slope
    slopes = None if alibi_slopes is None else jnp.tile(jnp.asarray(alibi_slopes, jnp.float32), num_reqs)[:, None]
    out = ragged_paged_attention_mgpu(
        q.reshape(pairs * group, 1, head_dim),
        kv_cache.reshape(num_layers, 2, num_blocks * num_kv_heads, 1, block_size, head_dim),
        layer_idx, tables, jnp.repeat(seq_lens, num_kv_heads),
        jnp.arange(pairs + 1, dtype=jnp.int32) * group,
        scale=scale, block_q=64, block_kv=block_kv, max_concurrent_steps=max_concurrent_steps,
        num_ctas=num_ctas, causal=False, alibi_slopes=slopes, split_keys=split_keys, interpret=interpret)
    return out.reshape(num_reqs, num_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("scale", "num_ctas", "interpret"))
def mixed_attention_mgpu(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *, scale: float,
                         num_ctas: int | None = None, alibi_slopes=None, interpret=None):
    """Same contract as ragged_paged_attention_mgpu (causal; q dtype[T, N, D] -> dtype[T, N, D]), for the layouts
    both kernels take (mgpu_decode_supported). Requests of one query token (decodes, one-token chunks: the
    same computation) run in the packed decode kernel, every other request in the ragged kernel:

        q_lens [1, 1, 200, 0] -> decode kernel on rows [0, 1] (seq_lens [s0, s1, 0, 0]: the others empty);
                                 ragged kernel on rows [2, 202) (rows 0 and 1 unwritten, then filled)
    """
    num_tokens = q.shape[0]
    single = query_start_loc[1:] - query_start_loc[:-1] == 1
    rows = jnp.minimum(query_start_loc[:-1], num_tokens - 1)          # each request's first token
    decoded = paged_decode_attention_mgpu(q[rows], kv_cache, layer_idx, block_tables,
                                          jnp.where(single, seq_lens, 0), scale=scale, num_ctas=num_ctas,
                                          alibi_slopes=alibi_slopes, interpret=interpret)
    out = ragged_paged_attention_mgpu(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc,
                                      scale=scale, num_ctas=num_ctas, alibi_slopes=alibi_slopes,
                                      skip_single_tokens=True, interpret=interpret)
    # rows of the other requests' "first tokens" go to index T: dropped
    return out.at[jnp.where(single, rows, num_tokens)].set(decoded, mode="drop")
