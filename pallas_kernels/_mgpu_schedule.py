"""The work list of the Mosaic GPU ragged attention kernel (ragged_paged_attention_mgpu.py).

A tile is up to 2 * BQ consecutive query tokens of one request, one BQ-token half per compute
warpgroup; the kernel's persistent CTAs run (tile, head) items. This module computes, with a few jnp
ops before the launch, every tile's request, K/V steps and the rows each warpgroup loads and writes.

Tiles never write rows of another request. A request of q_len >= 2 * BQ tokens gets cdiv(q_len, 2 BQ)
tiles, the last shifted back to end at its last token; a tile with BQ <= n < 2 BQ tokens gives its
second warpgroup the half ending at the last token (overlapping the first: overlapping rows are
computed identically and written twice with the same values). A tile with n < BQ tokens (decodes,
short chunks) loads a BQ-row q tile clamped inside [0, Tp) and leaves its second warpgroup idle.
Zero tiles (no K/V steps) write zeros over the bucket padding, rows [query_start_loc[R], T).
skip_single: requests of one query token get no tile, and their rows are left unwritten, for a caller that
computes those rows with the packed decode kernel (paged_decode_attention_mgpu.mixed_attention_mgpu).
"""
from __future__ import annotations

import jax.numpy as jnp

COMPUTE_WGS = 2
# Columns of sched i32[NT, 2 + 4 * 2]: request (-1: none), K/V steps of the tile (0: a zero tile or
# none), then per compute warpgroup: first row of its q tile, first row it writes (relative to that),
# rows it writes (0: idle), position of the first written row.
REQ, STEPS, WG0 = 0, 1, 2
LOAD, LO, ROWS, POS = 0, 1, 2, 3


def tile_schedule(query_start_loc, seq_lens, num_tokens: int, num_rows: int, block_q: int, block_kv: int,
                  skip_single: bool = False):
    """-> (sched i32[NT, 2 + 4 * COMPUTE_WGS], i32 number of live tiles, NT): live tiles first, longest first.

    num_tokens T (rows of the output); num_rows Tp = max(T, BQ) (rows a clamped q tile may read).

    # q_lens [3, 0, 200], BQ 64, T 210 -> tile token ranges [0, 3) and [3, 131), [75, 203), zero [203, 210):
    #   tile [0, 3): WG0 loads rows [0, 64), writes 3 rows from 0; WG1 idle
    #   tile [75, 203): shifted back to end at token 203; both warpgroups full (WG1 rows [139, 203))
    #   zero tile: WG0 writes zeros to rows [203, 210); sorted after the three tiles with K/V steps
    """
    real, num_real = _request_tiles(query_start_loc, seq_lens, num_rows, block_q, block_kv, skip_single)
    zero, num_zero = _zero_tiles(query_start_loc[-1], num_tokens, block_q)
    sched = jnp.concatenate([real, zero])
    # Longest tiles first (the tail of the work list is made of short ones), then zero tiles, then none.
    is_zero_tile = jnp.arange(sched.shape[0]) >= real.shape[0]
    key = jnp.where(sched[:, REQ] >= 0, -sched[:, STEPS], 1)
    key = jnp.where(is_zero_tile, jnp.where(sched[:, WG0 + ROWS] > 0, 0, 1), key)
    return sched[jnp.argsort(key, stable=True)], num_real + num_zero, sched.shape[0]


def _request_tiles(query_start_loc, seq_lens, num_rows, block_q, block_kv, skip_single=False):
    num_reqs = seq_lens.shape[0]
    cta_tokens = COMPUTE_WGS * block_q
    num_tiles = -(-num_rows // cta_tokens) + num_reqs            # static bound on the tiles needed
    q_begin, q_end = query_start_loc[:-1], query_start_loc[1:]
    per_req = (q_end - q_begin + cta_tokens - 1) // cta_tokens
    if skip_single:
        per_req = jnp.where(q_end - q_begin == 1, 0, per_req)
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_req).astype(jnp.int32)])
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(cum[1:], tile, side="right").astype(jnp.int32), num_reqs - 1)
    real = tile < cum[num_reqs]
    qb, qe = q_begin[req], q_end[req]
    start = qb + (tile - cum[req]) * cta_tokens
    start = jnp.where(qe - qb >= cta_tokens, jnp.minimum(start, qe - cta_tokens), start)
    n = jnp.minimum(qe - start, cta_tokens)                         # tokens of this tile
    full = n >= block_q
    load0 = jnp.where(full, start, jnp.minimum(start, num_rows - block_q))
    load1 = jnp.where(full, start + n - block_q, load0)
    ctx = seq_lens[req] - (qe - qb) - qb                            # flat token x sits at ctx + x
    steps = (ctx + start + n + block_kv - 1) // block_kv            # keys [0, last position] needed
    zero = jnp.zeros_like(tile)
    cols = [jnp.where(real, req, -1), jnp.where(real, steps, 0),
            load0, start - load0, jnp.where(real, jnp.minimum(n, block_q), 0), ctx + start,
            load1, zero, jnp.where(real & full, block_q, 0), ctx + load1]
    return jnp.stack(cols, axis=1).astype(jnp.int32), cum[num_reqs]


def _zero_tiles(q_end, num_tokens, block_q):
    """Tiles of 2 * BQ rows over the bucket padding [q_end, T): no steps, WG halves of BQ rows."""
    cta_tokens = COMPUTE_WGS * block_q
    start = q_end + jnp.arange(-(-num_tokens // cta_tokens), dtype=jnp.int32) * cta_tokens
    rows0 = jnp.clip(num_tokens - start, 0, block_q)
    rows1 = jnp.clip(num_tokens - start - block_q, 0, block_q)
    none, zero = jnp.full_like(start, -1), jnp.zeros_like(start)
    load1 = jnp.where(rows1 > 0, start + block_q, start)          # in bounds even when idle
    cols = [none, zero, start, zero, rows0, none, load1, zero, rows1, none]
    return jnp.stack(cols, axis=1).astype(jnp.int32), jnp.sum(rows0 > 0).astype(jnp.int32)
