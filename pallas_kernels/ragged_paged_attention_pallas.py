"""Ragged paged attention in Pallas (Triton) for a flat batch of prefill chunks and decodes.

Legend as in ragged_paged_attention.py (T tokens, R requests, N/K heads, G = N // K, D, L, B, S, M), plus
Gp = G padded to a power of two, BQ query tokens per tile, BM = BQ * Gp rows per tile, BK = P * S keys
per inner iteration (P blocks).

A tile is BQ consecutive query tokens of ONE request times the Gp query heads of one kv head: its
[BM, D] rows are (token, head) pairs, so the G heads that share a kv head share every K/V load (GQA
without re-reads) and the dots stay at tensor-core size even for short chunks. Tiles never straddle two
requests: a request of q_len tokens gets cdiv(q_len, BQ) tiles, so at most cdiv(T, BQ) + R tiles exist;
the schedule (request and first token of each tile) is computed by a few jnp ops before the launch,
and tiles past the real count exit at once.

Each tile walks the request's keys from its window start to its last query position, gathering P blocks
per iteration from the paged cache; key tiles entirely at or before the tile's first query position
skip the causal mask. Query token i of request r sits at position seq_lens[r] - q_len[r] + i.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from ._checks import validate_q_and_cache

_NEG = -1e30
_LOG2E = 1.4426950408889634


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _ragged_kernel(layer_ref, tile_req_ref, tile_start_ref, query_start_loc_ref, seq_lens_ref,
                   block_tables_ref, q_ref, kv_ref, o_ref, *, scale, sliding_window, soft_cap,
                   tokens_per_tile, group_pad, blocks_per_iter):
    # layer_ref:           i32[1]
    # tile_req_ref:        i32[NT]          request of each tile, -1 for tiles past the real count
    # tile_start_ref:      i32[NT]          flat index of the tile's first query token
    # query_start_loc_ref: i32[R + 1]
    # seq_lens_ref:        i32[R]
    # block_tables_ref:    i32[R, M]
    # q_ref:               dtype[K, (T + BQ) * Gp, D]   row t * Gp + g is token t, head g of kv head k
    # kv_ref:              dtype[L, 2, B, K, S, D]
    # o_ref:               dtype[K, (T + BQ) * Gp, D]   rows of valid tokens written, others untouched
    t, h = pl.program_id(0), pl.program_id(1)
    block_size, head_dim = kv_ref.shape[-2], kv_ref.shape[-1]
    req = tile_req_ref[t]

    @pl.when(req >= 0)
    def _():
        bq, gp = tokens_per_tile, group_pad
        bm = bq * gp
        bk = blocks_per_iter * block_size
        layer = layer_ref[0]
        q_start = tile_start_ref[t]
        q_begin = query_start_loc_ref[req]
        q_end = query_start_loc_ref[req + 1]
        seq_len = seq_lens_ref[req]
        first_pos = seq_len - (q_end - q_begin) + (q_start - q_begin)   # position of the tile's token 0
        num_tokens = jnp.minimum(bq, q_end - q_start)                    # valid tokens in this tile
        kv_end = first_pos + num_tokens                                  # keys [.., kv_end) are needed
        kv_begin = 0
        if sliding_window is not None:
            kv_begin = (jnp.maximum(first_pos - sliding_window + 1, 0) // bk) * bk
        q = q_ref[h, pl.ds(q_start * gp, bm), :]                         # [BM, D]
        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        # base-2 softmax: exp2(x * log2(e)) == exp(x), one multiply folded into the scale
        qk_scale = scale if soft_cap is not None else scale * _LOG2E
        max_blocks = block_tables_ref.shape[1]
        row_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0) // gp

        def body(j, carry, masked):
            m, l, acc = carry
            block0 = kv_begin // block_size + j * blocks_per_iter
            idx = block0 + jax.lax.broadcasted_iota(jnp.int32, (blocks_per_iter,), 0)
            blocks = plgpu.load(block_tables_ref.at[req, pl.ds(block0, blocks_per_iter)],
                                mask=idx < max_blocks, other=0)              # [P]; past M -> null
            k = kv_ref[layer, 0, blocks, h, :, :].reshape(bk, head_dim)       # [BK, D]
            v = kv_ref[layer, 1, blocks, h, :, :].reshape(bk, head_dim)       # [BK, D]
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * qk_scale  # [BM, BK] f32
            if soft_cap is not None:
                s = (soft_cap * _LOG2E) * jnp.tanh(s / soft_cap)
            if masked:
                key_pos = block0 * block_size + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
                mask = key_pos <= row_pos
                if sliding_window is not None:
                    mask &= key_pos > row_pos - sliding_window
                s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.exp2(s - m_new[:, None])
            if masked:
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
            return m_new, l, acc

        carry = (jnp.full((bm,), _NEG, jnp.float32), jnp.zeros((bm,), jnp.float32),
                 jnp.zeros((bm, head_dim), jnp.float32))
        num_iters = pl.cdiv(kv_end - kv_begin, bk)
        # Key tiles wholly at or before the first query position need no causal mask (no window).
        num_full = 0 if sliding_window is not None else (first_pos + 1) // bk
        num_full = jnp.minimum(num_full, num_iters)
        carry = jax.lax.fori_loop(0, num_full, functools.partial(body, masked=False), carry)
        m, l, acc = jax.lax.fori_loop(num_full, num_iters, functools.partial(body, masked=True), carry)
        out = acc / jnp.where(l > 0.0, l, 1.0)[:, None]
        valid = jax.lax.broadcasted_iota(jnp.int32, (bm, head_dim), 0) // gp < num_tokens
        plgpu.store(o_ref.at[h, pl.ds(q_start * gp, bm), :], out.astype(o_ref.dtype), mask=valid)


def _tile_schedule(query_start_loc, num_tokens, tokens_per_tile):
    """Request and first token of every tile; tiles past the real count get request -1.

    # q_lens [3, 0, 9], BQ 4 -> tiles per request [1, 0, 3], cum [0, 1, 1, 4]
    #   tile_req [0, 2, 2, 2, -1, ...], tile_start [0, 3, 7, 11, ...], then both reversed
    """
    num_reqs = query_start_loc.shape[0] - 1
    num_tiles = -(-num_tokens // tokens_per_tile) + num_reqs
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                           jnp.cumsum((q_lens + tokens_per_tile - 1) // tokens_per_tile)]).astype(jnp.int32)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(cum[1:], tile, side="right").astype(jnp.int32), num_reqs - 1)
    start = query_start_loc[req] + (tile - cum[req]) * tokens_per_tile
    real = tile < cum[num_reqs]
    # Reversed: a request's last tiles attend to the most keys; launching them first shortens the tail.
    return (jnp.where(real, req, -1)[::-1], jnp.where(real, start, 0)[::-1], num_tiles)


def _launch(q2, kv_cache, layer, tile_req, tile_start, query_start_loc, seq_lens, tables, *, scale,
            sliding_window, soft_cap, tokens_per_tile, group_pad, blocks_per_iter, num_tiles,
            num_warps, num_stages, interpret):
    num_kv_heads = q2.shape[0]
    kernel = functools.partial(_ragged_kernel, scale=scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, tokens_per_tile=tokens_per_tile, group_pad=group_pad,
                               blocks_per_iter=blocks_per_iter)
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(q2.shape, q2.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(layer, tile_req, tile_start, query_start_loc, seq_lens, tables, q2, kv_cache)


def _validate(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc):
    validate_q_and_cache(q, kv_cache, layer_idx)
    num_reqs = seq_lens.shape[0]
    if (block_tables.ndim != 2 or block_tables.shape[0] != num_reqs or seq_lens.ndim != 1
            or query_start_loc.shape != (num_reqs + 1,)):
        raise ValueError(f"block_tables {block_tables.shape}, seq_lens {seq_lens.shape} and "
                         f"query_start_loc {query_start_loc.shape} disagree on the request count")
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "block_m",
                                             "block_k", "num_warps", "num_stages", "interpret"))
def ragged_paged_attention_pallas(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, *,
                                  scale: float, sliding_window: int | None = None,
                                  soft_cap: float | None = None, block_m: int | None = None,
                                  block_k: int | None = None, num_warps: int | None = None,
                                  num_stages: int = 2, interpret: bool | None = None):
    """Same contract as ragged_paged_attention_reference: q dtype[T, N, D] -> dtype[T, N, D].

    block_m: rows (query tokens x padded heads) per tile; block_k: keys per inner iteration.
    """
    _validate(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    block_m = block_m or (128 if head_dim <= 128 else 64)
    block_k = block_k or 64
    tokens_per_tile = max(1, block_m // group_pad)
    blocks_per_iter = max(1, block_k // block_size)
    if num_warps is None:
        # H100 sweep: 4 warps beat 8 on 128 x 64 tiles for D 128 at >= 2k tokens (386 vs 270 TFLOP/s)
        num_warps = 4
    tile_req, tile_start, num_tiles = _tile_schedule(query_start_loc, num_tokens, tokens_per_tile)
    # [T, N, D] -> [K, (T + BQ) * Gp, D]: a tile's rows are contiguous; the BQ pad tokens keep the last
    # tile's loads and (masked) stores inside the array.
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, tokens_per_tile), (0, 0), (0, group_pad - group), (0, 0)))
    q2 = q4.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    layer = jnp.asarray(layer_idx, jnp.int32).reshape(1)
    o2 = _launch(q2, kv_cache, layer, tile_req, tile_start, query_start_loc, seq_lens, block_tables,
                 scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                 tokens_per_tile=tokens_per_tile, group_pad=group_pad, blocks_per_iter=blocks_per_iter,
                 num_tiles=num_tiles, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    o = o2.reshape(num_kv_heads, num_tokens + tokens_per_tile, group_pad, head_dim)
    o = o[:, :num_tokens, :group].transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)
    # Rows no tile wrote (bucket padding past query_start_loc[R]) hold garbage: zero them.
    valid = jnp.arange(num_tokens) < query_start_loc[-1]
    return jnp.where(valid[:, None, None], o, 0).astype(q.dtype)
