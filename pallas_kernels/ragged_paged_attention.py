"""Ragged paged attention: a flat batch of prefill chunks and decodes attends over the paged KV cache.

Dimension legend (used in every shape comment and einsum string of this package):
  T tokens in the flat batch, R requests, N query heads, K kv heads, G = N // K query heads per kv head,
  D head dim, L layers, B blocks in the pool, S block size, M max blocks per request.

Inputs shared by every implementation:
  q:                f32/bf16[T, N, D]      query tokens, request r owns q[query_start_loc[r]:query_start_loc[r+1]]
  kv_cache:         dtype[L, 2, B, K, S, D] the whole pool; index 0 of axis 1 is K, 1 is V (or e4m3 bytes:
                                           _checks.FP8_CACHE_DTYPE, read through from_cache)
  layer_idx:        i32[]                  which layer of the pool to read
  block_tables:     i32[R, M]              logical -> physical block ids; padding entries are 0 (null block)
  seq_lens:         i32[R]                 tokens of context of each request, including this step's tokens
  query_start_loc:  i32[R + 1]             prefix sums of the query lengths; padded requests repeat the end
  alibi_slopes:     f32[N] or None         ALiBi: slope[n] * (key position - query position) added to the
                                           scaled (and soft-capped) scores of head n

The new tokens' K/V are already in the cache (written by `write_kv` before attention, as vLLM does), so
query token i of request r sits at position seq_lens[r] - q_len[r] + i and attends causally to cache
positions 0 .. that position. Tokens past query_start_loc[R] (bucket padding) and requests with
seq_len 0 produce zeros, never NaN.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._checks import dot_precision, from_cache


def _token_metadata(query_start_loc, seq_lens, num_tokens):
    """Request index and absolute position of every token of the flat batch.

    # query_start_loc [0, 2, 7, 10], T = 12 -> req_ids [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3]
    Tokens past the last request map to index R (a padding request) and are marked invalid.
    """
    num_reqs = seq_lens.shape[0]
    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    req_ids = jnp.searchsorted(query_start_loc[1:], token_idx, side="right").astype(jnp.int32)
    valid = req_ids < num_reqs
    req_ids_c = jnp.minimum(req_ids, num_reqs - 1)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    # position = context before this step's tokens + offset inside the request's query chunk
    positions = (seq_lens[req_ids_c] - q_lens[req_ids_c]) + (token_idx - query_start_loc[req_ids_c])
    return req_ids_c, positions, valid


def ragged_paged_attention_reference(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc,
                                     *, scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None, alibi_slopes=None):
    """Plain-jnp reference: gathers every token's whole block table. O(T * M * S) memory; for tests.

    Returns: dtype(q)[T, N, D].
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, _, num_kv_heads, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    req_ids, positions, valid = _token_metadata(query_start_loc, seq_lens, num_tokens)
    layer = kv_cache[layer_idx]                                   # [2, B, K, S, D]
    blocks = block_tables[req_ids]                                # [T, M]
    k = layer[0][blocks]                                          # [T, M, K, S, D]
    v = layer[1][blocks]
    max_blocks = blocks.shape[1]
    k = k.transpose(0, 1, 3, 2, 4).reshape(num_tokens, max_blocks * block_size, num_kv_heads, head_dim)
    v = v.transpose(0, 1, 3, 2, 4).reshape(num_tokens, max_blocks * block_size, num_kv_heads, head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    s = jnp.einsum("tkgd,tckd->tkgc", qg, from_cache(k, jnp.float32),
                   precision=dot_precision(qg.dtype)) * scale                 # [T, K, G, M*S]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = jnp.arange(max_blocks * block_size, dtype=jnp.int32)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, num_kv_heads, key_pos[None, :] - positions[:, None])
    mask = key_pos[None, :] <= positions[:, None]                 # causal, and inside seq_len
    if sliding_window is not None:
        mask &= key_pos[None, :] > positions[:, None] - sliding_window
    mask &= valid[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("tkgc,tckd->tkgd", p, from_cache(v, jnp.float32),
                   precision=dot_precision(p.dtype)) / jnp.where(l == 0, 1.0, l)
    return o.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def alibi_bias(alibi_slopes, num_kv_heads, distance):
    """ALiBi's score bias slope[n] * (key position - query position): alibi_slopes f32[N], distance
    i32[T, C] -> f32[T, K, G, C]."""
    slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, -1)
    return slopes[None, :, :, None] * distance.astype(jnp.float32)[:, None, None, :]


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "blocks_per_chunk"))
def ragged_paged_attention_xla(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *,
                               scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, alibi_slopes=None, blocks_per_chunk: int = 8):
    """XLA path (CPU, and GPU fallback): online softmax over chunks of `blocks_per_chunk` blocks.

    A while loop runs only over the chunks the longest sequence needs, so cost follows the real context
    length, not max_model_len. Same contract as the reference.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, _, num_kv_heads, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    chunk = min(blocks_per_chunk, max_blocks)
    num_chunks_cap = -(-max_blocks // chunk)
    # Pad the table so the last chunk can be sliced whole; padded entries point at the null block.
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks_cap * chunk - max_blocks)))
    req_ids, positions, valid = _token_metadata(query_start_loc, seq_lens, num_tokens)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale
    chunk_tokens = chunk * block_size
    max_len = jnp.max(jnp.where(valid, positions, -1)) + 1
    num_chunks = jnp.minimum((max_len + chunk_tokens - 1) // chunk_tokens, num_chunks_cap)

    def body(c, carry):
        m, l, acc = carry
        blocks = jax.lax.dynamic_slice_in_dim(tables, c * chunk, chunk, axis=1)[req_ids]   # [T, C]
        # One gather from the whole pool, the layer index in it: a slice of the layer taken before the loop
        # would be materialized as the loop's operand, a copy of the layer's pool every step (XLA:CPU).
        k = kv_cache[layer_idx, 0, blocks].transpose(0, 1, 3, 2, 4).reshape(num_tokens, chunk_tokens,
                                                                             num_kv_heads, head_dim)
        v = kv_cache[layer_idx, 1, blocks].transpose(0, 1, 3, 2, 4).reshape(num_tokens, chunk_tokens,
                                                                             num_kv_heads, head_dim)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, from_cache(k, jnp.float32), precision=dot_precision(qg.dtype))
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        if alibi_slopes is not None:
            s = s + alibi_bias(alibi_slopes, num_kv_heads, key_pos[None, :] - positions[:, None])
        mask = (key_pos[None, :] <= positions[:, None]) & valid[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > positions[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgc,tckd->tkgd", p, from_cache(v, jnp.float32),
                                                  precision=dot_precision(p.dtype))
        return m_new, l, acc

    init = (jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
